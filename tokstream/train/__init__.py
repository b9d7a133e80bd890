"""Training GPT-2 from converted datasets (the entry point is train/main.py; the loop is trainer.py)."""

# Before any module here imports streaming: without transformers and torchvision until they are used
# (streaming_import.py), about 4.5 s less start-up in every rank (bench/import_time.py).
from tokstream.train.streaming_import import import_streaming

import_streaming()
