"""Everything the parent checks before a rank starts: the cross-field checks (`checks.py`: static,
then runtime), the launchers' shared multi-node checks (`launch_checks.py`), the node's GPUs
(`gpus.py`), the model built on the meta device (`model.py`) and the dry step on two samples
(`dry_step.py`). It sits above every package whose objects it builds or asks; nothing below imports it.
"""
