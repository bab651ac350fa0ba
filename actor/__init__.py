"""Actors: engines that sample actions, agent prompt formats, episode rollout and the actor process."""
