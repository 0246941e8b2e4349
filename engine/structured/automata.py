"""What a compiled grammar can start but never finish, read from xgrammar's own byte automata.

xgrammar compiles every rule of a grammar into a byte automaton (edges on byte ranges, on other rules, epsilon
edges). Its matcher allows a token when the token's bytes continue what the automata can read, without asking
whether anything can still complete it: a part of a schema that can match nothing (a `pattern` such as
`[^\\s\\S]`, or one whose every match needs a raw control character, which the vocabulary never writes:
vocabulary.py) is allowed to start, and the request then dead-ends mid-generation with no token allowed.

`problem()` reads the automata xgrammar runs (its own reading of the regex, anchors and all), over the bytes a
vocabulary can write:
- EMPTY (exact): the root rule can finish on no byte string: no document fits;
- DEAD_END: the grammar is not reduced: some state reachable from the root, entered by reading a byte, cannot reach
  the end of its rule, so that part of the grammar can match nothing. A reduced grammar (every reachable state can
  finish, every rule it enters can complete) never dead-ends: whatever prefix the matcher allows extends to a
  complete document. The converse holds but where another alternative reads the same bytes and can finish
  (`(ab|ab[^\\s\\S])`): such a part is refused too, though the matcher would keep to the other.
Lookahead assertions are left out: they only narrow what the automata allow, so they never make a part that matches
nothing match something (they could keep the matcher out of a part reported here; no schema of the tests has one).

The automata are read from `xgrammar.testing._print_grammar_fsms` (text linear in the grammar's size; the
serialized grammar repeats every automaton once per rule), in xgrammar 0.2's format. `AutomataFormatError` says
the text was not understood: callers then skip the check (a schema is never refused on it).
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

Problem = Literal["empty", "dead_end"]
EMPTY: Problem = "empty"
DEAD_END: Problem = "dead_end"

# The bytes a vocabulary can write (vocabulary.py blanks every token holding one of the others): no control byte,
# no byte that never occurs in UTF-8. ALL_BYTES tells a part that matches nothing from one that needs those.
WRITABLE = frozenset(b for b in range(256) if b >= 0x20 and b not in (0xC0, 0xC1) and b < 0xF5)
ALL_BYTES = frozenset(range(256))

_BYTES, _RULE, _REPEAT, _EPS = 0, 1, 2, 3
_CHAR = r"\\x[0-9a-fA-F]{2}|\\u[0-9a-fA-F]{4}|\\U[0-9a-fA-F]{8}|\\.|[^\\]"
_EDGE = re.compile(
    rf"(?:\[({_CHAR})-({_CHAR})\]|'({_CHAR})'|Rule\((\d+)\)|Repeat\(rule=(\d+), min=(\d+), max=(-?\d+)\)|(Eps|EOS))"
    r"->(\d+)(, |$)"
)
_HEADER = re.compile(
    r"Rule (\d+): (.*?), FSM: (?:None|CompactFSM\(num_states=\d+, start=(\d+), end=\[([\d, ]*)\], edges=\[)"
)
_STATE = re.compile(r"(\d+): \[(.*)\]")
_NAMED = {"0": 0, "a": 7, "b": 8, "t": 9, "n": 10, "v": 11, "f": 12, "r": 13, "e": 27}


class AutomataFormatError(ValueError):
    """xgrammar printed its automata in a form this module does not read."""


@dataclass
class _Rule:
    name: str
    start: int | None  # None: no automaton (xgrammar matches the rule another way): taken as able to finish
    ends: list[int] = field(default_factory=list)


@dataclass
class Automata:
    """One grammar's automata: rules by id (rule 0 is not necessarily the root) and edges by state."""

    rules: dict[int, _Rule]
    edges: dict[int, list[tuple[int, int, int, int]]]  # state -> [(kind, low byte or rule id, high byte, target)]

    @classmethod
    def of(cls, grammar: Any) -> Automata:
        """The automata of a compiled grammar (`xgrammar.CompiledGrammar.grammar`)."""
        from xgrammar.testing import _print_grammar_fsms

        return cls.parse(_print_grammar_fsms(grammar))

    @classmethod
    def parse(cls, text: str) -> Automata:
        rules: dict[int, _Rule] = {}
        edges: dict[int, list[tuple[int, int, int, int]]] = {}
        for line in text.splitlines():
            if not line or line == "])":
                continue
            header = _HEADER.fullmatch(line)
            if header is not None:
                rule_id, name, start, ends = header.groups()
                if start is None:
                    rules[int(rule_id)] = _Rule(name, None)
                else:
                    rules[int(rule_id)] = _Rule(name, int(start), [int(e) for e in ends.split(",") if e.strip()])
                continue
            state = _STATE.fullmatch(line)
            if state is None or not rules:
                raise AutomataFormatError(f"unexpected line {line[:120]!r}")
            edges[int(state.group(1))] = _edges(state.group(2))
        if not rules:
            raise AutomataFormatError("no rules")
        return cls(rules, edges)

    def problem(self, writable: frozenset[int] = WRITABLE, root: str = "root") -> Problem | None:
        """EMPTY, DEAD_END or None (reduced: every prefix the matcher allows can be completed), for the grammar
        rooted at the rule named `root` (xgrammar's name for a JSON schema's), over the bytes in `writable`."""
        roots = [rule_id for rule_id, rule in self.rules.items() if rule.name == root]
        if len(roots) != 1:
            raise AutomataFormatError(f"{len(roots)} rules named {root!r}")
        root_id = roots[0]
        if self.rules[root_id].start is None:
            return None
        readable = _Ranges(writable)
        live = self._live(readable)
        if self.rules[root_id].start not in live:
            return EMPTY
        consumes = self._consuming(readable, live)
        for state in self._reachable(root_id, readable, live):
            for kind, low, high, target in self.edges.get(state, ()):
                if target in live:
                    continue
                if kind == _BYTES and readable.any(low, high):
                    return DEAD_END  # a byte read leads where nothing can finish
                if kind in (_RULE, _REPEAT) and low in consumes:
                    return DEAD_END  # bytes read inside the rule, and what follows it cannot finish
        return None

    def _finishes(self, rule_id: int, live: set[int]) -> bool:
        rule = self.rules.get(rule_id)
        return rule is None or rule.start is None or rule.start in live

    def _passable(self, edge: tuple[int, int, int, int], readable: _Ranges, live: set[int]) -> bool:
        """The edge can be taken on the way to finishing: a readable byte, epsilon, or a rule that can complete
        (a repetition of none at all passes too)."""
        kind, low, high, _ = edge
        if kind == _BYTES:
            return readable.any(low, high)
        if kind == _EPS:
            return True
        return (kind == _REPEAT and high == 0) or self._finishes(low, live)

    def _live(self, readable: _Ranges) -> set[int]:
        """States from which the end of their rule is reachable (through rules that can complete)."""
        back: dict[int, list[tuple[int, tuple[int, int, int, int]]]] = {}
        callers: dict[int, list[tuple[int, int]]] = {}
        for source, out in self.edges.items():
            for edge in out:
                back.setdefault(edge[3], []).append((source, edge))
                if edge[0] in (_RULE, _REPEAT):
                    callers.setdefault(edge[1], []).append((source, edge[3]))
        starts = {rule.start: rule_id for rule_id, rule in self.rules.items() if rule.start is not None}
        live: set[int] = set()
        queue: deque[int] = deque()

        def mark(state: int) -> None:
            if state not in live:
                live.add(state)
                queue.append(state)

        for rule in self.rules.values():
            for end in rule.ends:
                mark(end)
        while queue:
            state = queue.popleft()
            for source, edge in back.get(state, ()):
                if self._passable(edge, readable, live):
                    mark(source)
            if state in starts:  # this rule can complete now: its callers whose next state is live are live
                for source, target in callers.get(starts[state], ()):
                    if target in live:
                        mark(source)
        return live

    def _inside(self, rule_id: int, readable: _Ranges, live: set[int]) -> set[int]:
        """The states of a rule reachable from its start (past a called rule only where that rule completes)."""
        rule = self.rules.get(rule_id)
        if rule is None or rule.start is None:
            return set()
        seen = {rule.start}
        queue = deque(seen)
        while queue:
            for edge in self.edges.get(queue.popleft(), ()):
                if edge[3] not in seen and self._passable(edge, readable, live):
                    seen.add(edge[3])
                    queue.append(edge[3])
        return seen

    def _consuming(self, readable: _Ranges, live: set[int]) -> set[int]:
        """Rules that, once entered, can read at least one byte (rules without an automaton are taken to)."""
        calls: dict[int, set[int]] = {}
        consumes = {rule_id for rule_id, rule in self.rules.items() if rule.start is None}
        for rule_id in self.rules:
            for state in self._inside(rule_id, readable, live):
                for kind, low, high, _ in self.edges.get(state, ()):
                    if kind == _BYTES and readable.any(low, high):
                        consumes.add(rule_id)
                    elif kind in (_RULE, _REPEAT):
                        calls.setdefault(rule_id, set()).add(low)
        changed = True
        while changed:
            changed = False
            for rule_id, called in calls.items():
                if rule_id not in consumes and called & consumes:
                    consumes.add(rule_id)
                    changed = True
        return consumes

    def _reachable(self, root: int, readable: _Ranges, live: set[int]) -> set[int]:
        """Every state the matcher can be in, in any rule entered from the root."""
        entered, states = {root}, set()
        queue = deque([root])
        while queue:
            inside = self._inside(queue.popleft(), readable, live)
            states |= inside
            for state in inside:
                for kind, low, _, _ in self.edges.get(state, ()):
                    if kind in (_RULE, _REPEAT) and low not in entered:
                        entered.add(low)
                        queue.append(low)
        return states


class _Ranges:
    """Whether a byte range holds a readable byte, in O(1)."""

    def __init__(self, readable: frozenset[int]) -> None:
        self._count = [0]
        for b in range(256):
            self._count.append(self._count[-1] + (b in readable))

    def any(self, low: int, high: int) -> bool:
        return self._count[min(high, 255) + 1] - self._count[max(low, 0)] > 0


def _edges(text: str) -> list[tuple[int, int, int, int]]:
    """(kind, low byte or rule id, high byte or least repetitions, target) per edge of one state."""
    out: list[tuple[int, int, int, int]] = []
    position = 0
    for match in _EDGE.finditer(text):
        if match.start() != position:
            break
        low, high, single, rule, repeated, least, most, special, target, _ = match.groups()
        if rule is not None:
            out.append((_RULE, int(rule), 0, int(target)))
        elif repeated is not None:  # `most` is -1 when unbounded; 0 repetitions at most is an epsilon edge
            out.append((_EPS, 0, 0, int(target)) if most == "0" else (_REPEAT, int(repeated), int(least), int(target)))
        elif special is not None:  # an EOS edge ends the grammar: read as an epsilon edge to its target
            out.append((_EPS, 0, 0, int(target)))
        elif single is not None:
            byte = _byte(single)
            out.append((_BYTES, byte, byte, int(target)))
        else:
            out.append((_BYTES, _byte(low), _byte(high), int(target)))
        position = match.end()
    if position != len(text):
        raise AutomataFormatError(f"unexpected edges {text[position : position + 80]!r}")
    return out


def _byte(char: str) -> int:
    if len(char) == 1:
        value = ord(char)
    elif char[1] in "xuU":
        value = int(char[2:], 16)
    else:
        value = _NAMED.get(char[1], ord(char[1]))
    if value > 255:
        raise AutomataFormatError(f"an edge on {char!r}, not a byte")
    return value
