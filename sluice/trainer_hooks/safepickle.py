"""Read a pickle without running pickle: a small stack machine over `pickletools.genops`.

Python's unpickler lets the file name any importable callable and call it, so a
pickle is code. torch.distributed.checkpoint (DCP) stores its ``.metadata`` as
one, and ``dcp.load`` hands it to ``pickle.load``: whoever can write a
checkpoint folder (and fix its digest in an unsigned manifest) runs code in the
trainer, the drill and the verifier.

`PickleReader` never imports, calls or sets anything on behalf of the file. It
uses `pickletools.genops` (a parser: it decodes opcodes and their arguments and
executes nothing) and interprets only the opcodes plain data needs: scalars,
strings, tuples, lists, dicts, the memo, and GLOBAL/REDUCE/NEWOBJ/BUILD for the
names in a fixed table of `Global` entries that the caller writes. A name
outside the table, an opcode outside the list, a REDUCE of something that is
not a table entry, a BUILD of an object the table did not create (or a second
BUILD of one) is refused with `UnsafePickle` naming the opcode and its byte
offset. The machine has no recursion; its memory is bounded by the file size,
which the caller bounds.

Why not `pickle.Unpickler` with a restricted ``find_class``: its BUILD opcode
sets attributes on any object on the stack, classes included, so a file made of
nothing but allowlisted names can still rewrite those classes for the whole
process. torch's own ``weights_only`` machine has no such hole but reads only
pickle protocol 2, and DCP writes protocol 4.
"""

from __future__ import annotations

import pickletools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class UnsafePickle(Exception):
    """The pickle needs something the reader does not allow (or is malformed); names opcode and offset."""


@dataclass(frozen=True)
class Global:
    """What one allowed global may do.

    `value`: the global is this constant (a dtype) and cannot be called.
    `reduce(args)`: REDUCE with an args tuple makes the object.
    `new()`: NEWOBJ with empty args makes a blank object. `build(obj, state)`
    fills in an object that `new` or `reduce` made, at most once (BUILD); one
    never built is refused unless `bare_ok` (an object whose every field has a
    default pickles without BUILD).
    """

    value: Any = None
    reduce: Callable[[tuple], Any] | None = None
    new: Callable[[], Any] | None = None
    build: Callable[[Any, Any], None] | None = None
    bare_ok: bool = False


class _Ref:
    """A table entry on the stack (never handed out in the result)."""

    __slots__ = ("name", "entry")

    def __init__(self, name: str, entry: Global) -> None:
        self.name, self.entry = name, entry


_PLAIN = {  # opcodes that push one scalar or string (their argument, or the constant below)
    "NONE", "NEWTRUE", "NEWFALSE", "BININT", "BININT1", "BININT2", "LONG1", "BINFLOAT",
    "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "SHORT_BINBYTES", "BINBYTES",
}
_CONST = {"NONE": None, "NEWTRUE": True, "NEWFALSE": False}
_MAX_DEPTH = 10_000  # MARKs open at once: plain data nests a few levels, not thousands
# Tuples nested deeper than this are refused: hashing a tuple (a dict key, a set member)
# recurses in C without a recursion check, and a million-deep one kills the process.
_MAX_TUPLE_DEPTH = 64


class PickleReader:
    """Interprets one pickle against a table of allowed globals ("module name" -> Global)."""

    def __init__(self, table: dict[str, Global], persistent: Callable[[Any], Any] | None = None) -> None:
        self.table = table
        self.persistent = persistent  # BINPERSID handler; None refuses persistent IDs

    def load(self, data: bytes) -> Any:
        """The object `data` encodes; UnsafePickle on anything outside the allowed subset."""
        try:
            return self._run(data)
        except UnsafePickle:
            raise
        except (ValueError, TypeError, IndexError, KeyError, AttributeError, OverflowError, RecursionError,
                MemoryError) as exc:
            # genops raises ValueError on a truncated or unknown opcode; the rest are
            # wrong shapes (an unhashable dict key, a tuple where a list belongs).
            raise UnsafePickle(f"malformed pickle ({type(exc).__name__}: {str(exc)[:200]})") from None

    def _run(self, data: bytes) -> Any:
        stack: list[Any] = []
        marks: list[list[Any]] = []
        memo: dict[int, Any] = {}
        blank: dict[int, tuple[str, Global, Any]] = {}  # id -> (name, entry, obj): NEWOBJ'd, not yet built
        depths: dict[int, tuple[tuple, int]] = {}  # id -> (tuple, its nesting depth), for every tuple made

        def make_tuple(items: list[Any]) -> tuple:
            depth = 1 + max((depths[id(v)][1] for v in items if id(v) in depths and depths[id(v)][0] is v),
                            default=0)
            if depth > _MAX_TUPLE_DEPTH:
                raise UnsafePickle(f"tuples nested deeper than {_MAX_TUPLE_DEPTH} at byte {pos}")
            t = tuple(items)
            depths[id(t)] = (t, depth)
            return t

        def pop_mark() -> list[Any]:
            nonlocal stack
            if not marks:
                raise UnsafePickle(f"{name} without MARK at byte {pos}")
            items, stack = stack, marks.pop()
            return items

        def value(obj: Any) -> Any:
            if isinstance(obj, _Ref):
                raise UnsafePickle(f"global {obj.name} used as a value at byte {pos}")
            return obj

        end = None
        for op, arg, pos in pickletools.genops(data):
            name = op.name
            # the most frequent opcodes first: protocol 4 memoizes every object it writes
            if name == "MEMOIZE" or name == "BINPUT" or name == "LONG_BINPUT":
                memo[len(memo) if name == "MEMOIZE" else arg] = stack[-1]
            elif name == "BINGET" or name == "LONG_BINGET":
                if arg not in memo:
                    raise UnsafePickle(f"{name} of memo slot {arg}, never stored, at byte {pos}")
                stack.append(memo[arg])
            elif name in _PLAIN:
                stack.append(_CONST[name] if name in _CONST else arg)
            elif name in ("PROTO", "FRAME"):
                pass
            elif name == "STOP":
                end = pos + 1
                break
            elif name == "MARK":
                if len(marks) >= _MAX_DEPTH:
                    raise UnsafePickle(f"nested deeper than {_MAX_DEPTH} at byte {pos}")
                marks.append(stack)
                stack = []
            elif name == "EMPTY_DICT":
                stack.append({})
            elif name == "EMPTY_LIST":
                stack.append([])
            elif name == "EMPTY_TUPLE":
                stack.append(())
            elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
                n = int(name[-1])
                if len(stack) < n:
                    raise UnsafePickle(f"{name} on a short stack at byte {pos}")
                items = [value(v) for v in stack[-n:]]
                del stack[-n:]
                stack.append(make_tuple(items))
            elif name in ("TUPLE", "LIST"):
                items = [value(v) for v in pop_mark()]  # pop_mark() rebinds `stack`: pop first, then push
                stack.append(make_tuple(items) if name == "TUPLE" else items)
            elif name == "DICT":
                items = [value(v) for v in pop_mark()]
                stack.append(dict(zip(items[::2], items[1::2], strict=True)))
            elif name in ("APPEND", "APPENDS"):
                items = [stack.pop()] if name == "APPEND" else pop_mark()
                target = stack[-1]
                if type(target) is not list:
                    raise UnsafePickle(f"{name} to a {type(target).__name__} at byte {pos}")
                target.extend(value(v) for v in items)
            elif name in ("SETITEM", "SETITEMS"):
                items = stack[-2:] if name == "SETITEM" else pop_mark()
                if name == "SETITEM":
                    del stack[-2:]
                target = stack[-1]
                if type(target) not in (dict, OrderedDict):
                    raise UnsafePickle(f"{name} into a {type(target).__name__} at byte {pos}")
                if len(items) % 2:
                    raise UnsafePickle(f"{name} with an odd number of items at byte {pos}")
                for k, v in zip(items[::2], items[1::2], strict=True):
                    target[value(k)] = value(v)
            elif name in ("GLOBAL", "STACK_GLOBAL"):
                if name == "GLOBAL":
                    module, _, attr = str(arg).partition(" ")
                else:
                    attr, module = stack.pop(), stack.pop()
                    if type(module) is not str or type(attr) is not str:
                        raise UnsafePickle(f"STACK_GLOBAL of non-strings at byte {pos}")
                full = f"{module} {attr}"
                entry = self.table.get(full)
                if entry is None:
                    raise UnsafePickle(f"global {module}.{attr} is not allowed (at byte {pos})")
                if entry.reduce is None and entry.new is None:
                    stack.append(entry.value)
                else:
                    stack.append(_Ref(f"{module}.{attr}", entry))
            elif name == "REDUCE":
                args, fn = stack.pop(), stack[-1]
                if not isinstance(fn, _Ref) or fn.entry.reduce is None or type(args) is not tuple:
                    raise UnsafePickle(f"REDUCE of {getattr(fn, 'name', type(fn).__name__)} at byte {pos}")
                obj = fn.entry.reduce(args)
                if fn.entry.build is not None:  # an object that may be filled in by one BUILD (OrderedDict)
                    blank[id(obj)] = (fn.name, fn.entry, obj)
                stack[-1] = obj
            elif name == "NEWOBJ":
                args, cls = stack.pop(), stack[-1]
                if not isinstance(cls, _Ref) or cls.entry.new is None or args != ():
                    raise UnsafePickle(f"NEWOBJ of {getattr(cls, 'name', type(cls).__name__)} at byte {pos}")
                obj = cls.entry.new()
                blank[id(obj)] = (cls.name, cls.entry, obj)
                stack[-1] = obj
            elif name == "BUILD":
                state, obj = stack.pop(), stack[-1]
                made = blank.pop(id(obj), None)
                if made is None or made[2] is not obj:
                    raise UnsafePickle(f"BUILD of a {type(obj).__name__} the reader did not create blank "
                                       f"(or built twice) at byte {pos}")
                assert made[1].build is not None
                made[1].build(obj, value(state))
            elif name == "BINPERSID":
                if self.persistent is None:
                    raise UnsafePickle(f"persistent ID at byte {pos}")
                stack.append(self.persistent(value(stack.pop())))
            else:
                raise UnsafePickle(f"opcode {name} is not allowed (at byte {pos})")
        if end is None:
            raise UnsafePickle("pickle has no STOP")
        if end != len(data):
            raise UnsafePickle(f"{len(data) - end} bytes after STOP")
        if marks or len(stack) != 1:
            raise UnsafePickle("pickle leaves an unbalanced stack")
        unbuilt = sorted({n for n, entry, _ in blank.values() if not entry.bare_ok})
        if unbuilt:
            names = unbuilt
            raise UnsafePickle(f"objects created and never filled in: {names}")
        return value(stack[0])
