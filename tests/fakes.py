"""Fakes shared by tests: engines that inject a fault in the middle of an episode."""


class InterruptedEngine:
    """Plays as `engine` does, except that `interrupt()` runs just before turn `turn` is
    generated: a fault (a killed browser, a killed service) lands mid-episode, at a known point."""

    policy_version = 0

    def __init__(self, engine, *, turn: int, interrupt) -> None:
        self.engine, self.turn, self.interrupt = engine, turn, interrupt
        self.tokenizer = engine.tokenizer
        self.turns = 0

    async def generate(self, request):
        self.turns += 1
        if self.turns == self.turn:
            self.interrupt()
        return await self.engine.generate(request)

    def end_episode(self, episode_id: str) -> None:
        self.engine.end_episode(episode_id)
