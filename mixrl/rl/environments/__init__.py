"""Environments: the API a task family implements (:mod:`.base`, :mod:`.tools`), how the spec names
one (:mod:`.registry`), where tasks come from (:mod:`.datasets`), and the built-in ``filetree``
(:mod:`.filetree`).  docs/rollout.md#bring-your-own-environment says how to write one."""
