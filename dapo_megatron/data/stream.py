"""DP-sharded, per-epoch shuffled, exactly resumable prompt stream on NVIDIA DALI.

Order of prompts (a pure function of ``seed``, ``epoch`` and the step):

* epoch ``e`` uses the permutation ``P_e`` of ``0..N-1`` drawn by
  ``numpy.random.Generator(PCG64(SeedSequence([seed, e]))).permutation(N)``
  (identity when ``shuffle=False``): a different order every epoch, the same
  on every run;
* one *global* batch holds ``batch_size * dp_size`` prompts. Step ``s`` of the
  epoch takes ``P_e[s*G:(s+1)*G]`` (``G = batch_size * dp_size``) and DP rank
  ``r`` gets the slice ``[r*batch_size:(r+1)*batch_size]`` of it. So within an
  epoch the ranks' prompts are disjoint, and the global batch of a step does
  not depend on ``dp_size`` (a DP=2 run sees the same prompts per step as a
  DP=1 run with twice the batch size);
* ``drop_last=True``: ``N // G`` steps per epoch, the ``N % G`` tail (a
  different one each epoch) is not used. ``drop_last=False``: the permutation
  is extended by wrapping around its start to a multiple of ``G`` (as
  ``torch.utils.data.DistributedSampler`` pads), so every prompt is used and
  every rank still gets the same number of full batches (no collective hang).

Why ``fn.external_source`` and not ``fn.readers.numpy``: the reader's
``random_shuffle`` draws from a shuffle buffer with an internal RNG, it rotates
shards between epochs, and its restore granularity is the reader's checkpoint,
not a (epoch, step) pair a trainer checkpoint can store. Feeding the pipeline
from a stateless callback that maps the pipeline iteration ``i`` to global
step ``start + i`` gives an order fixed by the formula above, and DALI's
prefetching cannot desynchronise it: the callback is a pure function of the
step, and each batch carries its own ``(epoch, step)`` as a second pipeline
output. The consumer records the position of the last batch it *returned*,
so :meth:`PromptStream.state_dict` is exact even though DALI has already
prepared batches ahead; :meth:`PromptStream.load_state_dict` rebuilds the
pipeline to start at the saved position.

DALI runs CPU-only (``device_id=None``) and is imported lazily.

Design: docs/design.md §1 step 1 (the prompt stream, restored exactly by a checkpoint).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dapo_megatron.data.dataset import PromptRecord


def _import_dali():
    try:  # DALI (nvidia-dali-cuda130) is imported only where a stream is read
        from nvidia.dali import fn, types
        from nvidia.dali.pipeline import Pipeline
    except ImportError as exc:
        raise ImportError(
            "PromptStream needs NVIDIA DALI: pip install nvidia-dali-cuda130 "
            "(its CPU-only pipelines are used; no GPU needed)"
        ) from exc
    return Pipeline, fn, types


def epoch_permutation(num_prompts: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """Prompt order of ``epoch``: int64 array of shape ``[num_prompts]``.

    ``PCG64(SeedSequence([seed, epoch])).permutation`` when ``shuffle``; else ``arange``.
    """
    if not shuffle:
        return np.arange(num_prompts, dtype=np.int64)
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch])))
    return rng.permutation(num_prompts).astype(np.int64)


class PromptStream:
    """Yields this DP rank's next ``batch_size`` prompts per step (see module doc).

    Args:
        dataset: indexable of :class:`PromptRecord` (e.g. ``PromptDataset``);
            ``dataset[i].index`` should be ``i``.
        batch_size: prompts per step on THIS rank (verl ``data.train_batch_size``
            divided by the DP size).
        dp_rank, dp_size: data-parallel rank and world size (Megatron's DP group).
        seed: shuffle seed (``data.seed``).
        drop_last: drop the epoch tail that does not fill a global batch
            (``True``) or wrap around to fill it (``False``).
        shuffle: reshuffle per epoch (``data.shuffle``); ``False`` keeps file order.

    Raises:
        ValueError: bad sizes/ranks, or fewer prompts than one global batch with
            ``drop_last=True`` (an epoch would have zero steps).
        ImportError: DALI is not installed.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        drop_last: bool = True,
        shuffle: bool = True,
    ):
        if batch_size <= 0:
            raise ValueError(f"PromptStream: batch_size must be > 0 prompts per rank, got {batch_size}")
        if dp_size <= 0 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"PromptStream: need 0 <= dp_rank < dp_size, got dp_rank={dp_rank} dp_size={dp_size}")
        n = len(dataset)
        global_batch = batch_size * dp_size
        if n == 0:
            raise ValueError("PromptStream: the dataset is empty")
        if drop_last and n < global_batch:
            raise ValueError(
                f"PromptStream: {n} prompts < one global batch of {global_batch} "
                f"(batch_size {batch_size} x dp_size {dp_size}); lower the batch size or set drop_last=False"
            )
        self.dataset = dataset
        self.num_prompts = n
        self.batch_size = batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.drop_last = drop_last
        self.shuffle = shuffle
        self.global_batch_size = global_batch
        self.steps_per_epoch = n // global_batch if drop_last else -(-n // global_batch)
        self._epoch = 0  # position of the next batch to return
        self._step = 0
        self._perm_cache: tuple[int, np.ndarray] | None = None
        self._pipe = None

    # ------------------------------------------------------------------ order

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm_cache is None or self._perm_cache[0] != epoch:
            perm = epoch_permutation(self.num_prompts, self.seed, epoch, self.shuffle)
            padded = self.steps_per_epoch * self.global_batch_size
            if padded > len(perm):
                perm = np.resize(perm, padded)  # np.resize repeats from the start
            self._perm_cache = (epoch, perm)
        return self._perm_cache[1]

    def batch_indices(self, epoch: int, step: int) -> np.ndarray:
        """This rank's prompt indices at (``epoch``, ``step``): int64 ``[batch_size]``."""
        if not 0 <= step < self.steps_per_epoch:
            raise ValueError(f"step must be in [0, {self.steps_per_epoch}), got {step}")
        start = step * self.global_batch_size + self.dp_rank * self.batch_size
        return self._permutation(epoch)[start : start + self.batch_size]

    # ------------------------------------------------------------------ DALI

    def _build_pipeline(self) -> None:
        Pipeline, fn, types = _import_dali()
        start = self._epoch * self.steps_per_epoch + self._step
        bs = self.batch_size

        def source(info):  # pure function of the pipeline iteration
            g = start + info.iteration
            epoch, step = divmod(g, self.steps_per_epoch)
            idx = self.batch_indices(epoch, step)
            pos = np.array([epoch, step], dtype=np.int64)
            return [np.asarray(i, dtype=np.int64) for i in idx], [pos] * bs

        pipe = Pipeline(batch_size=bs, num_threads=1, device_id=None, prefetch_queue_depth=2, seed=self.seed)
        with pipe:
            indices, position = fn.external_source(
                source=source, num_outputs=2, batch=True, batch_info=True, dtype=types.INT64
            )
            pipe.set_outputs(indices, position)
        pipe.build()
        self._pipe = pipe

    def next_indices(self) -> np.ndarray:
        """This rank's next prompt indices (int64 ``[batch_size]``) from the DALI pipeline."""
        if self._pipe is None:
            self._build_pipeline()
        indices, position = self._pipe.run()
        idx = indices.as_array().reshape(-1)
        epoch, step = (int(v) for v in position.as_array()[0])
        if (epoch, step) != (self._epoch, self._step):  # would mean DALI reordered batches
            raise RuntimeError(
                f"PromptStream: pipeline produced position {(epoch, step)}, expected {(self._epoch, self._step)}"
            )
        self._step = step + 1
        self._epoch = epoch
        if self._step == self.steps_per_epoch:
            self._epoch, self._step = epoch + 1, 0
        return idx

    def next_batch(self) -> list[PromptRecord]:
        """This rank's next ``batch_size`` prompts; crosses epochs transparently."""
        return [self.dataset[int(i)] for i in self.next_indices()]

    @property
    def epoch(self) -> int:
        """Epoch of the next batch."""
        return self._epoch

    # ------------------------------------------------------------------ resume

    def state_dict(self) -> dict[str, int]:
        """Position of the next batch: ``{"epoch", "offset", ...}``.

        ``offset`` is the step within the epoch (batches already returned this
        epoch). ``seed``, ``num_prompts``, ``global_batch_size`` and
        ``drop_last`` are stored to detect a resume with a different order.
        Per-rank offsets are equal, so saving rank 0's state is enough.
        """
        return {
            "epoch": self._epoch,
            "offset": self._step,
            "seed": self.seed,
            "num_prompts": self.num_prompts,
            "global_batch_size": self.global_batch_size,
            "drop_last": int(self.drop_last),
            "shuffle": int(self.shuffle),
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue at the saved position; the next batch is the one that would
        have followed the save.

        Raises:
            ValueError: the state was saved with a different seed, dataset size,
                global batch size, drop_last or shuffle (the order would differ),
                or its offset is out of range.
        """
        for key in ("epoch", "offset"):
            if key not in state:
                raise ValueError(f"PromptStream.load_state_dict: missing '{key}' in {sorted(state)}")
        mine = self.state_dict()
        for key in ("seed", "num_prompts", "global_batch_size", "drop_last", "shuffle"):
            if key in state and int(state[key]) != mine[key]:
                raise ValueError(
                    f"PromptStream.load_state_dict: saved {key}={state[key]} but this stream has "
                    f"{key}={mine[key]}; resume with the same data, batch size, DP size and seed"
                )
        epoch, offset = int(state["epoch"]), int(state["offset"])
        if epoch < 0 or not 0 <= offset < self.steps_per_epoch:
            raise ValueError(
                f"PromptStream.load_state_dict: epoch {epoch} / offset {offset} out of range "
                f"(steps_per_epoch={self.steps_per_epoch})"
            )
        self._epoch, self._step = epoch, offset
        self._pipe = None  # rebuilt lazily from the restored position
