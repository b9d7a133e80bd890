"""Shared by the converters (encode), verify and the ledger (decode): a tiktoken encoding, or a Hugging Face
`tokenizers` tokenizer.json (file or hub name).

Every tokenizer gives the same facts to the on-disk format: a name, the sha256 of its file (the
identity a dataset records), the vocabulary size, and the document separator: its id and whether
it goes after each document (end-of-text: GPT-2, nanoGPT) or before it (begin-of-text: Llama-3,
llm.c's fineweb.py).

GPT-2's BPE ranks, split pattern and single special token are identical to tiktoken's `r50k_base`,
and `r50k_base` is one file (GPT-2's own loader needs two), so "gpt2" is served from the
`r50k_base` file. tiktoken itself downloads it, or reads it from `TIKTOKEN_CACHE_DIR`;
`--ranks-file` (or `TOKSTREAM_RANKS_FILE`) points at a local `.tiktoken` file instead. A tiktoken
encoding's sha256 is that of its ranks file as tiktoken stores it.
"""

import base64
import hashlib
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from tokstream.errors import UserError

# Same regex tiktoken uses for gpt2 and r50k_base.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
GPT2_EOT = "<|endoftext|>"
ENCODING_ALIASES = {"gpt2": "r50k_base"}
RANKS_FILE_ENV = "TOKSTREAM_RANKS_FILE"
POSITIONS = ("after", "before")
# A tokenizer.json's separator when --separator is auto: the first of these it holds.
KNOWN_SEPARATORS = (("after", "<|endoftext|>"), ("before", "<|begin_of_text|>"))
# Tokenizer.sha256 of the encodings whose ranks file is known here (r50k_base's: the hash tiktoken itself
# expects), so a dataset's name and hash are checked against each other offline (verify.py).
KNOWN_SHA256 = {"r50k_base": "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"}


@dataclass(frozen=True)
class TokenizerSpec:
    """What names a tokenizer, small and picklable: a worker process loads it again from this."""

    source: str = "gpt2"  # tiktoken encoding name, path to a tokenizer.json, or a hub repository with one
    ranks_file: str | None = None  # a local .tiktoken file for gpt2/r50k_base (offline)
    separator: str = "auto"  # auto, or after:TOKEN / before:TOKEN


class Tokenizer:
    """A loaded tokenizer; `encode_batch` gives each text's ids, special-token text read as plain text."""

    spec: TokenizerSpec
    name: str
    vocab_size: int
    separator_id: int
    separator_position: str

    @property
    def sha256(self) -> str:
        raise NotImplementedError

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError


def identity_contradiction(name: str, sha256: str | None) -> str | None:
    """Why a tokenizer `name` cannot have this `sha256`, by the hashes known here (KNOWN_SHA256); None if it can,
    or if neither is known."""
    if sha256 is None:
        return None
    expected = KNOWN_SHA256.get(ENCODING_ALIASES.get(name, name))
    if expected is not None:
        return None if expected == sha256 else f"tokenizer {name!r} has sha256 {expected[:12]}, not {sha256[:12]}"
    owner = next((known for known, digest in KNOWN_SHA256.items() if digest == sha256), None)
    return None if owner is None else f"sha256 {sha256[:12]} is {owner}'s, not that of tokenizer {name!r}"


def _separator(spec: TokenizerSpec, vocabulary: dict[str, int], where: str) -> tuple[int, str]:
    """The separator's id and position: as --separator says, or the first known one the vocabulary holds."""
    if spec.separator == "auto":
        for position, token in KNOWN_SEPARATORS:
            if token in vocabulary:
                return vocabulary[token], position
        raise UserError(f"{where} holds none of {', '.join(t for _, t in KNOWN_SEPARATORS)}: name the document "
                        "separator with --separator after:TOKEN (end of each document) or before:TOKEN (its start)")
    position, _, token = spec.separator.partition(":")
    if position not in POSITIONS or not token:
        raise UserError(f"--separator {spec.separator!r}: give auto, after:TOKEN or before:TOKEN")
    if token not in vocabulary:
        raise UserError(f"--separator {spec.separator}: {where} has no token {token!r}")
    return vocabulary[token], position


class TiktokenTokenizer(Tokenizer):
    def __init__(self, spec: TokenizerSpec):
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        self.spec, self.name = spec, spec.source
        ranks_file = spec.ranks_file or os.environ.get(RANKS_FILE_ENV)
        if ranks_file:
            if spec.source not in ("gpt2", "r50k_base"):
                raise UserError(f"--ranks-file only supports the gpt2/r50k_base encoding, not {spec.source!r}")
            if not os.path.isfile(ranks_file):
                raise UserError(f"ranks file {ranks_file} does not exist")
            with open(ranks_file, "rb") as handle:
                digest = hashlib.sha256(handle.read()).hexdigest()
            if digest != KNOWN_SHA256["r50k_base"]:  # a dataset must not carry GPT-2's name over other ranks
                raise UserError(f"ranks file {ranks_file} is not GPT-2's BPE ranks (sha256 {digest[:12]}, not "
                                f"{KNOWN_SHA256['r50k_base'][:12]}): pass the r50k_base.tiktoken file, or another "
                                "tokenizer as --tokenizer tokenizer.json")
            ranks = load_tiktoken_bpe(ranks_file)
            self.encoding = tiktoken.Encoding(name=spec.source, pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                                              special_tokens={GPT2_EOT: len(ranks)})
        else:
            try:
                self.encoding = tiktoken.get_encoding(ENCODING_ALIASES.get(spec.source, spec.source))
            except ValueError as err:
                first_line = str(err).strip().splitlines()[0]  # tiktoken lists its plugins on the lines after
                raise UserError(f"unknown tiktoken encoding {spec.source!r} ({first_line}), and no tokenizer.json of "
                                "that name: give the tokenizer (--tokenizer)") from None
            except Exception as err:  # network or cache failures surface as many exception types
                raise UserError(
                    f"could not load tiktoken encoding {spec.source!r}: {type(err).__name__}: {err}. Offline? "
                    "set TIKTOKEN_CACHE_DIR to a tiktoken cache or pass --ranks-file r50k_base.tiktoken"
                ) from None
        self.vocab_size = self.encoding.n_vocab
        if spec.separator == "auto":
            self.separator_id, self.separator_position = self.encoding.eot_token, "after"
        else:
            specials = {token: self.encoding.encode_single_token(token) for token in self.encoding.special_tokens_set}
            self.separator_id, self.separator_position = _separator(spec, specials, f"tiktoken encoding {self.name}")

    @cached_property
    def sha256(self) -> str:
        """The sha256 of the ranks file as tiktoken stores it (base64 token, space, rank, per line)."""
        digest = hashlib.sha256()
        specials = {self.encoding.encode_single_token(token) for token in self.encoding.special_tokens_set}
        for rank in range(self.encoding.n_vocab):
            if rank in specials:
                continue
            try:
                token = self.encoding.decode_single_token_bytes(rank)
            except KeyError:  # a gap in the ranks
                continue
            digest.update(base64.b64encode(token) + b" " + str(rank).encode() + b"\n")
        return digest.hexdigest()

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encoding.encode_ordinary(text) for text in texts]

    def decode(self, ids: list[int]) -> str:
        return self.encoding.decode(ids)


class HuggingFaceTokenizer(Tokenizer):
    """A `tokenizers` tokenizer.json: a file, or a hub repository's (downloaded through huggingface_hub)."""

    def __init__(self, spec: TokenizerSpec, path: Path):
        from tokenizers import Tokenizer as Backend

        self.spec, self.name, self.path = spec, spec.source, path
        try:
            self.backend = Backend.from_file(str(path))
        except Exception as err:  # tokenizers raises its own Exception for a malformed file
            raise UserError(f"{path} is not a readable tokenizer.json: {err}") from None
        self.backend.encode_special_tokens = True  # a special token's text in a document is text, as in tiktoken
        vocabulary = self.backend.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocabulary.values()) + 1
        self.separator_id, self.separator_position = _separator(spec, vocabulary, str(path))

    @cached_property
    def sha256(self) -> str:
        return hashlib.sha256(self.path.read_bytes()).hexdigest()

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # Its own batch call (threads in Rust); no special tokens added (the separator is ours to place).
        return [encoding.ids for encoding in self.backend.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=False)


def _hub_tokenizer_file(repository: str) -> Path:
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(repository, "tokenizer.json"))
    except Exception as err:  # offline, gated, or no such repository
        raise UserError(f"{repository!r} is neither a tiktoken encoding, a tokenizer.json file, nor a hub repository "
                        f"with a tokenizer.json reachable from here ({type(err).__name__}); pass a local "
                        "tokenizer.json") from None


def load_tokenizer(source: str | TokenizerSpec = "gpt2", ranks_file: str | None = None,
                   separator: str = "auto") -> Tokenizer:
    """A tiktoken encoding by name, a tokenizer.json file, or a hub repository's tokenizer.json."""
    spec = source if isinstance(source, TokenizerSpec) else TokenizerSpec(source, ranks_file, separator)
    if spec.source.endswith(".json") or Path(spec.source).is_file():
        if not Path(spec.source).is_file():
            raise UserError(f"tokenizer file {spec.source} does not exist")
        return HuggingFaceTokenizer(spec, Path(spec.source))
    if "/" in spec.source and not spec.ranks_file:  # owner/name: a hub repository
        return HuggingFaceTokenizer(spec, _hub_tokenizer_file(spec.source))
    return TiktokenTokenizer(spec)


def dataset_tokenizer(metadata, where: str, source: str | None = None, ranks_file: str | None = None) -> Tokenizer:
    """The tokenizer a dataset was converted with, to decode its samples: the one its metadata names, or
    `source`; refused if its file is not the one the metadata records."""
    tokenizer = load_tokenizer(source or metadata.tokenizer, ranks_file)
    if metadata.tokenizer_sha256 and tokenizer.sha256 != metadata.tokenizer_sha256:
        raise UserError(f"{source or metadata.tokenizer} is not the tokenizer {where} was converted with (sha256 "
                        f"{tokenizer.sha256[:12]}, the metadata says {metadata.tokenizer_sha256[:12]})")
    return tokenizer
