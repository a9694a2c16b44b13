"""`disttrain.dist.gather_batch` without a process group. Its rows, offsets and gradients across 2
ranks with an uneven batch are checked by tests/integration/test_batchnorm_and_gather.py: the docs'
contrastive recipe on 2 ranks follows one process holding the global batch, step for step."""

from __future__ import annotations

import torch

from disttrain.dist import gather_batch


def test_without_a_process_group_the_batch_is_its_own() -> None:
    """The parent's dry step runs the task before any rank exists."""
    t = torch.ones(3, 2)
    rows, start = gather_batch(t)
    assert rows is t and start == 0
