"""streaming imported by training without transformers and torchvision (streaming_import.py), and
everything of streaming that needs them still the real thing when used. Each check runs in a fresh
interpreter: what a module import does happens once per process."""

import subprocess
import sys

from conftest import ROOT


def run(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_training_imports_streaming_without_transformers_or_torchvision():
    out = run("""
import sys
import tokstream.train.trainer, tokstream.reader.batches
import streaming
print(sorted(m for m in ("transformers", "torchvision", "torch._dynamo") if m in sys.modules))
print(streaming.StreamingDataset.__name__)
""")
    assert out.splitlines() == ["[]", "StreamingDataset"]


def test_a_streaming_that_wants_more_of_transformers_is_imported_the_ordinary_way():
    """As a later streaming version that imports another transformers name would: the import still works."""
    out = run("""
import sys
sys.modules["tokstream.reader"] = type(sys)("tokstream.reader")  # this module alone, not the package's import
sys.modules["tokstream.reader"].__path__ = ["tokstream/reader"]
from tokstream.reader.streaming_door import streaming_import
for module, names in streaming_import._DEFERRED.items():  # wherever this streaming imports it from
    streaming_import._DEFERRED[module] = tuple(name for name in names if name != "BatchEncoding")
streaming = streaming_import.import_streaming()
from transformers import BatchEncoding
print(streaming.StreamingDataLoader._get_batch_size.__globals__["BatchEncoding"] is BatchEncoding,
      streaming.StreamingDataset.__name__)
""")
    assert out.splitlines() == ["True StreamingDataset"]


def test_streamings_batch_check_is_stocks_before_and_after_transformers_is_imported():
    """StreamingDataLoader counts samples per batch by an isinstance check against transformers'
    batch classes: a dict or tensor batch without transformers imported, then BatchEncoding and
    BatchFeature batches, which must count as stock counts them (by their first value)."""
    out = run("""
import sys
import torch
import tokstream.reader.batches
from streaming import StreamingDataLoader
count = StreamingDataLoader._get_batch_size
print(count(None, {"x": torch.zeros(3, 2)}), count(None, torch.zeros(5, 2)), count(None, [torch.zeros(7)]),
      "transformers" in sys.modules)
from transformers import BatchEncoding, BatchFeature
print(count(None, BatchEncoding({"ids": torch.zeros(4, 2)})), count(None, BatchFeature({"px": torch.zeros(6, 2)})))
as_streaming_sees_it = StreamingDataLoader._get_batch_size.__globals__["BatchEncoding"]  # what its check reads
print(issubclass(BatchEncoding, as_streaming_sees_it), isinstance({}, as_streaming_sees_it))
""")
    assert out.splitlines() == ["3 5 7 False", "4 6", "True False"]


def test_streamings_own_datasets_import_what_they_need_when_used():
    out = run("""
import sys
import tokstream.reader.batches
import streaming
from streaming.vision import StreamingCIFAR10
print(StreamingCIFAR10.__module__, "torchvision" in sys.modules, "transformers" in sys.modules)
import streaming.text.c4
from transformers.models.auto.tokenization_auto import AutoTokenizer
print(streaming.text.StreamingC4.__module__, streaming.text.c4.AutoTokenizer is AutoTokenizer)
print(streaming.multimodal.StreamingInsideWebVid.__module__)
import transformers
print(transformers.__file__.endswith("transformers/__init__.py"), hasattr(transformers, "AutoModel"))
""")
    assert out.splitlines() == ["streaming.vision.cifar10 True False", "streaming.text.c4 True",
                                "streaming.multimodal.webvid", "True True"]
