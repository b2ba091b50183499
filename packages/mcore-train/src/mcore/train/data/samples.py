"""The training sample and batch layout shared by every GPT dataset here.

A sample is built from ``seq_length + 1`` consecutive tokens ``x``: ``tokens = x[:-1]``, ``labels = x[1:]``.

Sample keys (tensors of length ``s = seq_length``):

- ``tokens`` int64 ``[s]``, ``labels`` int64 ``[s]`` (``-100`` where the loss is masked), ``loss_mask`` float32 ``[s]``
  (1 where the loss counts), ``position_ids`` int64 ``[s]``;
- with packing only: ``cu_seqlens`` int32 ``[k + 1]``, the starts of the sample's ``k`` document segments and ``s``.

Without packing, attention spans document boundaries and positions run ``0..s-1`` (Megatron's default). With
packing, positions restart at 0 at every document start and ``cu_seqlens`` tells attention where documents end.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

IGNORE_INDEX = -100


def build_sample(
    window: np.ndarray,
    document_starts: Sequence[int] | np.ndarray,
    *,
    packing: bool,
    eod_id: int | None = None,
    eod_mask_loss: bool = False,
) -> dict[str, torch.Tensor]:
    """Turn ``seq_length + 1`` tokens into a training sample (keys in the module docstring).

    ``document_starts`` are the positions in ``window`` where a document begins (any order; positions 0 and those
    at or past ``seq_length`` do not split the inputs and are ignored). ``eod_mask_loss`` masks the loss of the
    prediction made at each ``eod_id`` input token (the first token of the next document), as Megatron's
    ``--eod-mask-loss`` does.
    """
    window = np.asarray(window)
    if window.ndim != 1 or window.size < 2:
        raise ValueError(f"a sample window needs seq_length + 1 >= 2 tokens in 1-D, got shape {window.shape}")
    if eod_mask_loss and eod_id is None:
        raise ValueError("eod_mask_loss=True needs eod_id, the id of the end-of-document token")
    s = window.size - 1
    x = torch.from_numpy(window.astype(np.int64))
    tokens, labels = x[:-1].clone(), x[1:].clone()
    loss_mask = torch.ones(s, dtype=torch.float32)
    if eod_mask_loss:
        loss_mask[tokens == eod_id] = 0.0
    labels[loss_mask == 0] = IGNORE_INDEX
    sample = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask}
    if packing:
        starts = np.asarray(document_starts, dtype=np.int64)
        inner = np.unique(starts[(starts > 0) & (starts < s)])
        bounds = np.concatenate(([0], inner, [s]))
        lengths = np.diff(bounds)
        # position = index - start of its segment
        segment_start = np.repeat(bounds[:-1], lengths)
        sample["position_ids"] = torch.from_numpy(np.arange(s, dtype=np.int64) - segment_start)
        sample["cu_seqlens"] = torch.from_numpy(bounds.astype(np.int32))
    else:
        sample["position_ids"] = torch.arange(s, dtype=torch.int64)
    return sample


def collate_gpt_batch(samples: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor | int]:
    """Stack samples into a batch: ``[b, s]`` tensors, and for packed samples the batch's ``cu_seqlens``.

    ``cu_seqlens`` (int32 ``[n + 1]``) holds the document boundaries over the flattened ``b * s`` tokens, as
    ``mcore.kernels.attention`` expects: every multiple of ``s`` is a boundary. ``max_seqlen`` (a Python int, the
    longest segment) comes with it so that attention kernels need no device-to-host copy.
    """
    if not samples:
        raise ValueError("cannot collate an empty list of samples")
    keys = set(samples[0])
    for k, sample in enumerate(samples):
        if set(sample) != keys:
            raise ValueError(
                f"sample {k} has keys {sorted(sample)} but sample 0 has {sorted(keys)}; "
                "packed and unpacked samples cannot share a batch"
            )
    batch: dict[str, torch.Tensor | int] = {}
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        shapes = {tuple(sample[key].shape) for sample in samples}
        if len(shapes) != 1:
            raise ValueError(f"samples disagree on the shape of {key!r}: {sorted(shapes)}")
        batch[key] = torch.stack([sample[key] for sample in samples])
    if "cu_seqlens" in keys:
        s = samples[0]["tokens"].shape[0]
        pieces = [sample["cu_seqlens"][:-1].to(torch.int64) + b * s for b, sample in enumerate(samples)]
        pieces.append(torch.tensor([len(samples) * s], dtype=torch.int64))
        cu = torch.cat(pieces)
        batch["cu_seqlens"] = cu.to(torch.int32)
        batch["max_seqlen"] = int((cu[1:] - cu[:-1]).max())
    return batch
