"""Compatibility with Megatron-core releases (0.16.1-0.19.x): the one module that imports
``megatron`` (``mcore``: the version range, the API differences between releases) and the
workarounds for upstream behaviour, one function each (``cpu_patches`` for the CPU, ``patches``
for every device, ``known_warnings`` for the warnings that do not apply).

Nothing here knows about plans: the layers above (``binding``, ``model``, ``parallel``) import it,
never the other way round.
"""

__all__: list[str] = []
