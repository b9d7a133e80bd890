"""Loading the tiktoken encoding, online or from a local ranks file.

GPT-2's BPE ranks, split pattern and single special token are identical to
tiktoken's `r50k_base`, and `r50k_base` is one file (GPT-2's own loader needs
two), so "gpt2" is served from the `r50k_base` file. tiktoken itself downloads
it, or reads it from `TIKTOKEN_CACHE_DIR`; `--ranks-file` (or the environment
variable `TOKSTREAM_RANKS_FILE`) points at a local `.tiktoken` file instead.
"""

import os
from dataclasses import dataclass

import tiktoken
from tiktoken.load import load_tiktoken_bpe

from tokstream.errors import UserError

# Same regex tiktoken uses for gpt2 and r50k_base.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
GPT2_EOT = "<|endoftext|>"
ENCODING_ALIASES = {"gpt2": "r50k_base"}
RANKS_FILE_ENV = "TOKSTREAM_RANKS_FILE"


@dataclass(frozen=True)
class Tokenizer:
    """A tiktoken encoding plus the facts the on-disk format records about it."""

    name: str
    encoding: tiktoken.Encoding
    ranks_file: str | None = None  # how to load it again in another process

    @property
    def vocab_size(self) -> int:
        return self.encoding.n_vocab

    @property
    def eot_id(self) -> int:
        return self.encoding.eot_token


def load_tokenizer(name: str = "gpt2", ranks_file: str | None = None) -> Tokenizer:
    """Return the named encoding; with a ranks file, build GPT-2's encoding from it offline."""
    ranks_file = ranks_file or os.environ.get(RANKS_FILE_ENV)
    if ranks_file:
        if name not in ("gpt2", "r50k_base"):
            raise UserError(f"--ranks-file only supports the gpt2/r50k_base encoding, not {name!r}")
        if not os.path.isfile(ranks_file):
            raise UserError(f"ranks file {ranks_file} does not exist")
        ranks = load_tiktoken_bpe(ranks_file)
        encoding = tiktoken.Encoding(
            name=name,
            pat_str=GPT2_PATTERN,
            mergeable_ranks=ranks,
            special_tokens={GPT2_EOT: len(ranks)},
        )
        return Tokenizer(name, encoding, ranks_file)
    try:
        encoding = tiktoken.get_encoding(ENCODING_ALIASES.get(name, name))
    except ValueError as err:
        raise UserError(f"unknown tiktoken encoding {name!r} ({err})") from None
    except Exception as err:  # network or cache failures surface as many exception types
        raise UserError(
            f"could not load tiktoken encoding {name!r}: {type(err).__name__}: {err}. Offline? "
            "set TIKTOKEN_CACHE_DIR to a tiktoken cache or pass --ranks-file r50k_base.tiktoken"
        ) from None
    return Tokenizer(name, encoding)
