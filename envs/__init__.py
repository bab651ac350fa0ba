"""Environments: the async text Env protocol, the registry and the environments themselves."""
