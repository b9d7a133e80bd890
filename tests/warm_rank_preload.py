"""What a rank of train/main.py imports, imported once in the forkserver its warm ranks are forked from
(tests/warm_ranks.py). An import that fails here fails loudly: the server would swallow an ImportError."""

from tokstream.train.cpu_dispatch import prefer_avx2_sort

prefer_avx2_sort()  # before numpy, as train/main.py does

from tokstream.train.process_start import start_up_frozen  # noqa: E402

try:
    with start_up_frozen():  # as train/main.py imports: no fork's collection then writes to those objects
        import torch._dynamo  # noqa: F401  (torch.optim's first step imports it)
        import torch.distributed.run  # noqa: F401  (torchrun's agent, tests/test_training.py's launch)

        import tokstream.reader.token_loader  # noqa: F401  (streaming, through the project's deferral)
        import tokstream.train.config  # noqa: F401
        import tokstream.train.process_exit  # noqa: F401
        import tokstream.train.trainer  # noqa: F401
except ImportError as err:
    raise RuntimeError(f"the warm ranks' preload failed: {err}") from err
