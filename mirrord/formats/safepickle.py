"""Read the structure of a pickle without running it: no import, no call, no object of the writer's choice.

`pickle.load` on a file from a checkpoint folder would run whatever the file names (any importable
callable, with any arguments). Here a `pickle.Unpickler` whose `find_class` returns an inert stand-in
class does the reading: the primitives, tuples, lists, dicts and sets come out as they are, and every
object the pickle would have constructed is an `Instance` that records the class *name*, the arguments
and the state it would have been given. A format reader (mirrord.formats.dcpmeta) then looks for the
fields it knows.

Before unpickling, the opcodes are walked once (`pickletools.genops` only parses) to bound how deeply the
values nest: a dict key nested a million tuples deep would otherwise be hashed by C code that recurses
until the process dies (docs/security.md, "Nesting and depth").
"""

from __future__ import annotations

import io
import pickle
import pickletools
from typing import Any, ClassVar

# DCP's Metadata nests about six levels deep; a hundred is far beyond any format mirrord reads.
MAX_DEPTH = 100


class UnreadableError(ValueError):
    """Not a pickle this reader can read (malformed, truncated, nested too deeply, or using persistent ids)."""


class Instance:
    """What the pickle would have built by calling `cls(*args)` (REDUCE, NEWOBJ) and then BUILD(state).

    Hashed by identity, as the objects it stands for are usually used as dict keys (dataclasses).
    """

    __slots__ = ("args", "kwargs", "state")
    cls: ClassVar[str] = ""
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    state: Any

    def __new__(cls, *args: Any, **kwargs: Any) -> Instance:
        """Record what the pickle would have called the class with."""
        self = super().__new__(cls)
        self.args, self.kwargs, self.state = args, kwargs, None
        return self

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def fields(self) -> dict[str, Any]:
        """The instance's attributes, from a BUILD state `dict` or `(dict, slots)`; {} if none."""
        parts = self.state if isinstance(self.state, tuple) and len(self.state) == 2 else (self.state,)
        return {key: value for part in parts if isinstance(part, dict) for key, value in part.items()}


class _StateDict(dict[Any, Any]):
    """An OrderedDict (a torch state_dict): its items as they are; the attributes set on it (`_metadata`) dropped."""

    def __setstate__(self, state: Any) -> None:
        pass


class _Unpickler(pickle.Unpickler):
    """Every name the pickle looks up is an Instance subclass named after it; nothing is imported."""

    def __init__(self, data: bytes, storages: bool = False) -> None:
        super().__init__(io.BytesIO(data))
        self._stand_ins: dict[str, type[Instance]] = {}
        self._storages = storages

    def find_class(self, module: str, name: str) -> type[Instance] | type[_StateDict]:
        qualname = f"{module}.{name}"
        if qualname == "collections.OrderedDict":  # a state_dict: read as the mapping it is
            return _StateDict
        if qualname not in self._stand_ins:
            self._stand_ins[qualname] = type(name, (Instance,), {"__slots__": (), "cls": qualname})
        return self._stand_ins[qualname]

    def persistent_load(self, pid: Any) -> Any:
        # torch.save's data.pkl names its storages by persistent id: another program's objects, never read.
        if self._storages:
            return None
        raise UnreadableError("persistent id (PERSID/BINPERSID): refers to objects outside the pickle; not read")


_MEMO_PUT = frozenset({"PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"})
_MEMO_GET = frozenset({"GET", "BINGET", "LONG_BINGET"})
# Opcodes that add to the container below their arguments: it keeps its place and grows no deeper.
_IN_PLACE = frozenset({"APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS", "BUILD"})


def check_depth(data: bytes, limit: int = MAX_DEPTH) -> None:
    """Raise UnreadableError if a value of the pickle nests deeper than `limit`, or the opcodes are malformed.

    Each stack slot holds the depth of the value pickle's machine would have there (a leaf 0, a container
    one more than its deepest part), moved by each opcode's documented stack effect: no value is built."""
    stack: list[int] = []
    marks: list[int] = []  # where each open MARK is on the stack; nothing below the last one may be popped
    memo: dict[Any, int] = {}
    try:
        for op, arg, pos in pickletools.genops(data):
            name = op.name
            if name in _MEMO_PUT:
                memo[len(memo) if name == "MEMOIZE" else arg] = stack[-1]
                continue
            if name in _MEMO_GET:
                stack.append(memo[arg])
                continue
            before = op.stack_before
            popped: list[int] = []
            if pickletools.markobject in before:
                at = marks.pop()
                popped = stack[at:]
                del stack[at:]
                before = before[: before.index(pickletools.markobject)]
            popped += [stack.pop() for _ in before]
            if marks and len(stack) < marks[-1]:
                raise UnreadableError(f"{name} at byte {pos} reaches below a MARK")
            if name in _IN_PLACE:
                container = popped.pop()
                depth = max(container, 1 + max(popped, default=-1))
            else:
                depth = 1 + max(popped, default=-1)
            if depth > limit and op.stack_after:  # (STOP pushes nothing)
                raise UnreadableError(f"values nested more than {limit} deep (at byte {pos}); not read")
            for after in op.stack_after:
                if after is pickletools.markobject:
                    marks.append(len(stack))
                else:
                    stack.append(popped[0] if name == "DUP" else depth)
    except (ValueError, IndexError, KeyError) as exc:  # genops' own errors, a missing MARK or memo entry
        if isinstance(exc, UnreadableError):
            raise
        raise UnreadableError(f"not a readable pickle: {exc}") from exc


def load(data: bytes, storages: bool = False) -> Any:
    """The value the pickle in `data` describes, with every constructed object as an `Instance`. `storages`:
    torch.save's data.pkl, whose tensor storages (records beside it in the zip) read as None."""
    check_depth(data)
    try:
        return _Unpickler(data, storages).load()
    except UnreadableError:
        raise
    except (
        pickle.UnpicklingError,
        EOFError,
        ValueError,
        TypeError,
        AttributeError,
        KeyError,
        IndexError,
        OverflowError,
    ) as exc:
        raise UnreadableError(f"not a readable pickle: {type(exc).__name__}: {exc}") from exc
