"""Read the structure of a pickle without running it: no import, no call, no object of the writer's choice.

`pickle.load` on a file from a checkpoint folder would run whatever the file names (any importable
callable, with any arguments): mirrord never does that. This module walks the opcodes instead
(`pickletools.genops` only parses) and builds inert values: the primitives, tuples, lists, dicts and
sets as they are, and every object the pickle would have constructed as an `Instance` that records the
class *name*, the arguments and the state it would have been given. A format reader (mirrord.formats.dcp)
then looks for the fields it knows.

Persistent ids and the extension registry (nothing in a plain pickle of dataclasses uses them) are
refused, as is anything malformed: `UnreadableError` names the opcode and offset.
"""

from __future__ import annotations

import pickletools
from dataclasses import dataclass, field
from typing import Any


class UnreadableError(ValueError):
    """Not a pickle this reader can walk (malformed, truncated, or using refused opcodes)."""


@dataclass(frozen=True, slots=True)
class Global:
    """A class or function the pickle names (never imported)."""

    module: str
    name: str

    @property
    def qualname(self) -> str:
        """`module.name`, as the pickle names it."""
        return f"{self.module}.{self.name}"


@dataclass(eq=False, slots=True)
class Instance:
    """What the pickle would have built by calling `cls(*args)` (REDUCE, NEWOBJ) and then BUILD(state).

    Hashed by identity, as the objects it stands for are usually used as dict keys (dataclasses).
    """

    cls: str
    args: tuple[Any, ...] = ()
    state: Any = None
    kwargs: dict[str, Any] = field(default_factory=dict)

    def fields(self) -> dict[str, Any]:
        """The instance's attributes, from a BUILD state `dict` or `(dict, slots)`; {} if none."""
        state = self.state
        if isinstance(state, tuple) and len(state) == 2:
            merged: dict[str, Any] = {}
            for part in state:
                if isinstance(part, dict):
                    merged.update(part)
            return merged
        return dict(state) if isinstance(state, dict) else {}


class _Mark:
    pass


_MARK = _Mark()
_IGNORED = frozenset({"PROTO", "FRAME"})
_PUSH_ARG = frozenset({
    "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "FLOAT", "BINFLOAT",
    "STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8",
    "BINBYTES", "SHORT_BINBYTES", "BINBYTES8",
})
_CONSTANTS = {"NONE": None, "NEWTRUE": True, "NEWFALSE": False}


def load(data: bytes) -> Any:
    """The value the pickle in `data` describes, with every constructed object as an `Instance`."""
    stack: list[Any] = []
    memo: dict[int, Any] = {}
    try:
        for op, arg, pos in pickletools.genops(data):
            name = op.name
            if name == "STOP":
                if len(stack) != 1:
                    raise UnreadableError(f"STOP at byte {pos} with {len(stack)} values on the stack")
                return stack[0]
            _step(name, arg, stack, memo, pos or 0)
    except UnreadableError:
        raise
    except (ValueError, TypeError, KeyError, IndexError) as exc:  # genops' own errors, unhashable keys, ...
        raise UnreadableError(f"not a readable pickle: {exc}") from exc
    raise UnreadableError("no STOP opcode: truncated")


def _pop_mark(stack: list[Any]) -> list[Any]:
    for i in range(len(stack) - 1, -1, -1):
        if stack[i] is _MARK:
            items = stack[i + 1 :]
            del stack[i:]
            return items
    raise UnreadableError("no MARK on the stack")


def _step(name: str, arg: Any, stack: list[Any], memo: dict[int, Any], pos: int) -> None:
    """One opcode, as pickle's own machine runs it, except that nothing is imported or called."""
    if name in _IGNORED:
        return
    if name in _PUSH_ARG:
        stack.append(arg)
    elif name in _CONSTANTS:
        stack.append(_CONSTANTS[name])
    elif name == "BYTEARRAY8":
        stack.append(bytearray(arg))
    elif name == "MARK":
        stack.append(_MARK)
    elif name == "POP":
        stack.pop()
    elif name == "POP_MARK":
        _pop_mark(stack)
    elif name == "DUP":
        stack.append(stack[-1])
    elif name in ("MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"):
        memo[len(memo) if name == "MEMOIZE" else int(arg)] = stack[-1]
    elif name in ("GET", "BINGET", "LONG_BINGET"):
        stack.append(memo[int(arg)])
    elif name == "EMPTY_TUPLE":
        stack.append(())
    elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
        n = int(name[-1])
        stack[-n:] = [tuple(stack[-n:])]
    elif name == "TUPLE":
        stack.append(tuple(_pop_mark(stack)))
    elif name == "EMPTY_LIST":
        stack.append([])
    elif name == "LIST":
        stack.append(_pop_mark(stack))
    elif name in ("APPEND", "APPENDS"):
        appended = [stack.pop()] if name == "APPEND" else _pop_mark(stack)
        _expect(stack[-1], list, name, pos).extend(appended)
    elif name == "EMPTY_DICT":
        stack.append({})
    elif name in ("DICT", "SETITEM", "SETITEMS"):
        pairs = stack[-2:] if name == "SETITEM" else _pop_mark(stack)
        if name == "SETITEM":
            del stack[-2:]
        if len(pairs) % 2:
            raise UnreadableError(f"{name} at byte {pos} with an odd number of items")
        target = {} if name == "DICT" else _expect(stack[-1], dict, name, pos)
        for key, value in zip(pairs[::2], pairs[1::2], strict=True):
            target[key] = value
        if name == "DICT":
            stack.append(target)
    elif name == "EMPTY_SET":
        stack.append(set())
    elif name == "ADDITEMS":
        added = _pop_mark(stack)
        _expect(stack[-1], set, name, pos).update(added)
    elif name == "FROZENSET":
        stack.append(frozenset(_pop_mark(stack)))
    elif name == "GLOBAL":
        module, _, qual = str(arg).partition(" ")
        stack.append(Global(module, qual))
    elif name == "STACK_GLOBAL":
        qual, module = stack.pop(), stack.pop()
        if not (isinstance(module, str) and isinstance(qual, str)):
            raise UnreadableError(f"STACK_GLOBAL at byte {pos} names a non-string")
        stack.append(Global(module, qual))
    elif name in ("REDUCE", "NEWOBJ"):
        args = stack.pop()
        cls = stack.pop()
        stack.append(Instance(_expect(cls, Global, name, pos).qualname, tuple(_expect(args, tuple, name, pos))))
    elif name == "NEWOBJ_EX":
        kwargs, args, cls = stack.pop(), stack.pop(), stack.pop()
        stack.append(Instance(_expect(cls, Global, name, pos).qualname, tuple(_expect(args, tuple, name, pos)),
                              kwargs=dict(_expect(kwargs, dict, name, pos))))
    elif name == "BUILD":
        state = stack.pop()
        _expect(stack[-1], Instance, name, pos).state = state
    else:  # PERSID, BINPERSID, EXT1/2/4, OBJ, INST: another program's objects, or protocol 0 classes
        raise UnreadableError(f"opcode {name} at byte {pos} is not read (only plain data and named classes are)")


def _expect(value: Any, kind: type, op: str, pos: int) -> Any:
    if isinstance(value, _Mark) or not isinstance(value, kind):
        raise UnreadableError(f"{op} at byte {pos} applied to a {type(value).__name__}, not a {kind.__name__}")
    return value
