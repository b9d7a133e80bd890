"""Where each document starts inside a micro-batch, from the separator the format records (format version 2:
its id, and whether it comes before or after each document), for attention that stays inside documents.

For the inputs of a micro-batch (each sample's first block_size tokens), per token: "positions", its
position within its document (0 where a document starts, and at each sample's start, where the document
may have begun in the sample before), and "documents", its document's index in the micro-batch (samples
cut apart: a document spanning two samples is two). Per micro-batch: "cu_seqlens", flash-attention's
varlen boundaries over the flattened (samples x block_size) inputs, padded to max_documents + 1 entries
with the total so that shapes stay static under torch.compile, and "document_count", how many it has.
A micro-batch of more documents than max_documents gives only its first max_documents starts to
cu_seqlens: its last sequence then holds all the rest together, across samples (a varlen kernel would
attend across them; "documents" and "positions" stay exact, and so does the trainer's document
attention, which uses them). TrainBatches warns when that happens.
"""

import numpy as np
import torch


def document_structure(tokens: np.ndarray, separator_id: int, separator_position: str,
                       max_documents: int) -> dict[str, torch.Tensor]:
    """The structure of a (samples, block_size + 1) token array's inputs."""
    inputs = np.asarray(tokens)[:, :-1]
    samples, length = inputs.shape
    starts = np.empty(inputs.shape, dtype=bool)
    if separator_position == "after":  # a document starts after each separator
        starts[:, 1:] = inputs[:, :-1] == separator_id
    else:  # "before": at each separator
        starts[:, 1:] = inputs[:, 1:] == separator_id
    starts[:, 0] = True
    flat = starts.ravel()
    index = np.arange(flat.size, dtype=np.int32)
    documents = np.cumsum(flat, dtype=np.int32)
    documents -= 1
    starts_at = np.where(flat, index, 0)
    np.maximum.accumulate(starts_at, out=starts_at)  # each token's document start
    positions = np.subtract(index, starts_at, out=index)
    boundaries = np.flatnonzero(flat)  # where each document starts
    cu_seqlens = np.full(max_documents + 1, flat.size, dtype=np.int32)
    kept = boundaries[:max_documents]
    cu_seqlens[:len(kept)] = kept
    return {"positions": torch.from_numpy(positions.reshape(samples, length)),
            "documents": torch.from_numpy(documents.reshape(samples, length)),
            "cu_seqlens": torch.from_numpy(cu_seqlens), "document_count": torch.tensor(len(boundaries))}
