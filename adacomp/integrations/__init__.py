"""Framework integrations: Lightning (:mod:`adacomp.integrations.lightning`) and Accelerate
(:mod:`adacomp.integrations.accelerate`). Each registers adacomp's DDP hook where the framework would
not (Lightning registers comm hooks on CUDA only), follows the framework's GradScaler, and keeps every
rank's compression state inside the framework's own checkpoints (:class:`adacomp.checkpoint.PerRank`).
Imported on demand: the frameworks are optional dependencies."""
