"""Text conversion as a whole: in one pass (text_one_pass.py), or part by part and merged (text_parts.py)."""

from tokstream.convert.cleaning import Cleaning
from tokstream.convert.options import ConversionOptions
from tokstream.convert.sources import open_source
from tokstream.convert.staging import refuse_existing_output
from tokstream.convert.text_one_pass import convert_documents
from tokstream.convert.text_parts import assign_files, convert_part, merge_parts, resolve_part
from tokstream.errors import UserError
from tokstream.format import DatasetMetadata
from tokstream.object_store import is_s3
from tokstream.tokenizer import Tokenizer


def convert_text(inputs: list[str], out: str, source_kwargs: dict, cleaning: Cleaning, options: ConversionOptions,
                 tokenizer: Tokenizer, num_parts: int | None = None, part: str | None = None,
                 merge: bool = False) -> DatasetMetadata | None:
    """Convert `inputs` into dataset `out`; returns None when only one part (of several) was run.

    Without num_parts: one pass. With num_parts: `part` runs that part only; `merge` joins finished
    parts; neither runs every unfinished part and then merges, so a killed run resumes by part.
    """
    source = open_source(inputs, **source_kwargs)
    source.description.update(cleaning.describe())
    if num_parts is None:
        if part is not None or merge:
            raise UserError("--part and --merge need --num-parts")
        return convert_documents(source, tokenizer, out, options, cleaning)

    if options.max_docs is not None:
        raise UserError("--max-docs cannot be combined with --num-parts")
    if not is_s3(out):
        refuse_existing_output(out, options.overwrite)  # before tokenizing parts for an output we may not write
    hub = source.description["kind"] != "local"  # a datasets stream: each part a run of its data files
    assignment = None if hub else assign_files(source.description["files"], num_parts)
    index = resolve_part(part, num_parts)
    todo = [] if merge else [index] if index is not None else list(range(num_parts))
    for number in todo:
        part_source = (open_source(inputs, **source_kwargs, part=(number, num_parts)) if hub else
                       open_source(assignment[number], **source_kwargs))
        written = convert_part(part_source, number, num_parts, out, tokenizer, options, cleaning)
        print(f"part {number} of {num_parts}: {'written' if written else 'already complete, kept'}")
    if index is not None:
        return None
    return merge_parts(out, num_parts, source.description, tokenizer, options, cleaning)
