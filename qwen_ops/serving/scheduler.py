"""The scheduler's old home: it is ``qwen_ops.engine.scheduler`` now (the engine layer owns the
scheduler, which owns the KV-cache manager); these names stay importable from here."""

from qwen_ops.engine.scheduler import (Scheduler, SchedulerConfig, SchedulerStuckError,  # noqa: F401
                                       iteration_bound)
