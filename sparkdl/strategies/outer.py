"""DiLoCo's outer optimizer: a round's averaged change of the weights, applied with Nesterov
momentum instead of taken as it is (Douillard et al., 2023; the modern form of SparkNet).

Weight averaging ends each round of ``sync_every`` local steps with every worker holding the
weighted average ``avg`` of the workers' weights. Plain averaging keeps it. With the outer
optimizer, the change of the round, ``delta = ref - avg`` (``ref``: the weights every worker
started the round from), is a pseudo-gradient for SGD with Nesterov momentum, as
``torch.optim.SGD(nesterov=True)`` would apply it to ``ref``::

    v   <- mu * v + delta
    new <- ref - lr * (delta + mu * v)

written as ``new = avg + (1 - lr) * delta - lr * mu * v``, so that with ``lr = 1`` and
``mu = 0`` the result *is* ``avg`` to the last bit (each added term is a zero). The paper's
values are ``lr = 0.7, mu = 0.9``; they let ``sync_every`` grow to hundreds of steps where plain
averaging loses accuracy.

Every worker runs the same step on the same averaged values, so all of them keep the same
``ref`` and ``v`` without any message; ``v`` goes into checkpoints (rank 0's copy stands for
all) and a resumed run starts from it, with ``ref`` the checkpointed weights (or, where the
checkpoint was written mid-round, as Streaming DiLoCo's are, the ``ref`` it carries).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

#: The checkpoint entry that holds the outer momentum (a list of CPU tensors, one per trainable
#: parameter: the frozen ones have none).
CHECKPOINT_KEY = "weight_averaging_outer_momentum"
#: The checkpoint entry that holds the weights the rounds under way started from, where they are
#: not the checkpointed weights (Streaming DiLoCo; a list of float32 CPU tensors, one per trainable
#: parameter).
REFERENCE_KEY = "weight_averaging_outer_reference"


class NesterovOuterStep:
    """The outer optimizer over ``parameters`` (the model's, changed in place).

    Args:
        parameters: the model's parameter tensors, as they stand at the start of the first round.
        lr: the outer learning rate.
        momentum: the outer Nesterov momentum.
        velocity: a checkpoint's momentum (CPU tensors, one per parameter), or None for zeros.
        reference: a checkpoint's ``ref`` (CPU tensors, one per parameter), or None for the
            parameters as they stand.
    """

    def __init__(
        self,
        parameters: Sequence[torch.Tensor],
        lr: float,
        momentum: float,
        velocity: Sequence[torch.Tensor] | None = None,
        reference: Sequence[torch.Tensor] | None = None,
    ) -> None:
        self._parameters = [p.detach() for p in parameters]
        self._lr, self._momentum = lr, momentum
        # float32 whatever the parameters' dtype: a bf16 model's small outer updates and its
        # momentum would otherwise round away
        self._reference = [
            p.float().clone()
            for p in self._checked(reference, "weights its rounds started from", self._parameters)
        ]
        if velocity is None:
            self._velocity = [torch.zeros_like(r) for r in self._reference]
        else:
            self._velocity = self._checked(velocity, "outer momentum", self._reference)

    def _checked(
        self, saved: Sequence[torch.Tensor] | None, what: str, like: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        """A checkpoint's tensors, one per parameter, as float32 on ``like``'s devices (``like``
        itself where there are none)."""
        if saved is None:
            return list(like)
        shapes = [tuple(v.shape) for v in saved]
        if shapes != [tuple(p.shape) for p in self._parameters]:
            raise ValueError(
                f"the checkpoint's {what} has {len(shapes)} tensors of shapes {shapes[:4]}..., "
                f"the model {len(self._parameters)} parameters: resume with the model that wrote it"
            )
        return [
            v.to(device=p.device, dtype=torch.float32, copy=True) for v, p in zip(saved, like, strict=True)
        ]

    @torch.no_grad()
    def step(self) -> None:
        """The parameters hold this round's average: move them to the outer step's result,
        which the next round starts from."""
        self.step_from([param.float() for param in self._parameters])
        for param, reference in zip(self._parameters, self._reference, strict=True):
            param.copy_(reference)
            reference.copy_(param)  # where the next round starts (rounded, for a bf16 model)

    @torch.no_grad()
    def step_from(self, averages: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The outer step on this round's ``averages`` (one per parameter), which leaves the
        parameters alone; return the new global weights (float32), the next round's start."""
        for reference, velocity, average in zip(self._reference, self._velocity, averages, strict=True):
            average = average.float()
            delta = reference - average  # the pseudo-gradient
            velocity.mul_(self._momentum).add_(delta)
            # ref - lr (delta + mu v), written so that lr 1, mu 0 leaves the average's bits
            new = average.add(delta, alpha=1.0 - self._lr).add_(velocity, alpha=-self._lr * self._momentum)
            reference.copy_(new)
        return self._reference

    @property
    def globals(self) -> list[torch.Tensor]:
        """The weights the next round starts from (float32), the same on every worker."""
        return self._reference

    def velocity(self) -> list[torch.Tensor]:
        """The outer momentum as CPU tensors, for a checkpoint."""
        return [v.detach().cpu().clone() for v in self._velocity]

    def reference(self) -> list[torch.Tensor]:
        """``ref`` as CPU tensors, for a checkpoint written mid-round."""
        return [r.detach().cpu().clone() for r in self._reference]
