"""Streaming behind one door: everything in tokstream that touches mosaicml-streaming's private names,
or replaces its module attributes, lives in this package and nowhere else (tests/test_layout.py).

- streaming_import.py: `import streaming` without transformers and torchvision until they are used.
- streaming_internals.py: the private names relied on, checked against the streaming versions it
  names (CHECKED_VERSIONS); WindowedDownloadAhead, the StreamingDataset the reader's dataset extends.
- epoch_order.py, lean_spanner.py, lean_readers.py, prefix_registration.py: equal, faster replacements for
  streaming's epoch order (its parts computed in tokstream/reader/order/), sample-to-shard lookup, per-shard readers
  and shared-memory numbering; install() also registers the project's own lazy orders (tokstream/reader/order/)
  under their names, beside stock's shuffles.

Importing any of it changes nothing in streaming. `install()` puts the replacements in place, for
every StreamingDataset built after it in this process; the reader's TokenDataset calls it. A process
that never builds a reader (a converter, a stock-streaming reference) keeps streaming as shipped.
"""


_installed = False


def install() -> None:
    """Put the project's replacements into streaming's modules, once per process (a later call changes
    nothing, so a test may put its own wrapper over one of them)."""
    global _installed
    if _installed:
        return
    _installed = True
    from tokstream.reader.streaming_door import epoch_order, lean_readers, lean_spanner, prefix_registration
    from tokstream.reader.streaming_door import streaming_internals as internals

    from tokstream.reader.order import py1e, sampling

    internals.install_epoch_order(sampling.get_sampling_vectorized, py1e.get_shuffle_py1e_fast,
                                  epoch_order.generate_work_random)
    internals.install_order_file_sequence(order_file_sequence)
    internals.install_spanner(lean_spanner.LeanSpanner)
    internals.install_reader_from_json(lean_readers.reader_from_json)
    from tokstream.reader.order import LAZY_ORDERS, whole_epoch

    for name in LAZY_ORDERS:
        internals.install_shuffle(name, whole_epoch(name))
    internals.install_prefix_registration(prefix_registration.get_shm_prefix_claimed)
    internals.install_file_lock()
    from tokstream.reader import stale_shm

    internals.install_node_barrier(stale_shm.ended_owners, stale_shm.locals_registration)
    internals.install_sized_attach()


def order_file_sequence(inputs, epoch: int):
    """An epoch's order for order/order_files.py (OrderInputs.compute): streaming's, as the readers compute it with the
    door installed (the same numbers as stock, faster), in whatever process builds the file. In py1e, the default,
    that is the order's own py1e, which install() puts in streaming's registry: the builder imports no streaming."""
    if not inputs.shuffle or inputs.shuffle_algo == "py1e":
        from tokstream.reader.order.stock_sequence import py1e_sequence

        return py1e_sequence(inputs, epoch)
    from tokstream.reader.streaming_door import epoch_order

    install()
    return epoch_order.epoch_sequence(inputs, epoch)
