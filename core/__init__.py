"""featcache's shared core: what every stage builds on, and nothing that knows a stage.

Infrastructure: :mod:`~featcache.core.configs` (frozen stage configs that are their own CLI
flags), :mod:`~featcache.core.devices` and :mod:`~featcache.core.cpu` (device choice, CPU
facts), :mod:`~featcache.core.allocator`, :mod:`~featcache.core.progress`,
:mod:`~featcache.core.formatting`, :mod:`~featcache.core.optional` (optional libraries) and
:mod:`~featcache.core._lazy` (lazy package exports).

Evaluation vocabulary shared by the stages: :mod:`~featcache.core.splits` (seeded split
plans), :mod:`~featcache.core.protocols` (the protocol registry),
:mod:`~featcache.core.metrics` (classification metrics), :mod:`~featcache.core.prompts`
(templates and class names for text towers), :mod:`~featcache.core.results` (the results
table every stage appends to) and :mod:`~featcache.core.stagerun` (the one finished ->
pending -> run -> collect skeleton).

Modules here import :mod:`featcache.errors` and each other, never a stage, the store or the
analysis (``tests/contracts/test_import_layers.py`` checks it). Importing this package imports none of
its modules.
"""

#: the modules are the API (``from featcache.core.protocols import ...``); the package exports no names
__all__: list[str] = []
