"""A radix tree over token vectors: where each stored vector ends, found in time linear in the query.

Lookups walk the query's tokens once, so their cost does not grow with the number
of stored vectors. Each node keeps the keys of the vectors that end exactly there
and a count of the vectors at or below it, so a walk can also report the deepest
point it shares with any stored vector (for trimming a cache that diverges).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Generic, TypeVar

from courier.core.token_prefix import common_prefix_length

K = TypeVar("K", bound=Hashable)
# A diverging match needs one snapshot to trim, not all of them: the walk below the shared point stops here.
MAX_SHARED_KEYS = 32
Tokens = tuple[int, ...]


@dataclass(slots=True, eq=False)
class _Node(Generic[K]):
    edges: dict[int, tuple[Tokens, _Node[K]]] = field(default_factory=dict)
    keys: set[K] = field(default_factory=set)
    below: int = 0  # vectors ending at or under this node


@dataclass(frozen=True, slots=True)
class PathMatch(Generic[K]):
    """Keys whose vectors are prefixes of the query (with their lengths), and the deepest shared point."""

    prefixes: tuple[tuple[int, frozenset[K]], ...]
    shared_length: int
    keys_below_shared: tuple[K, ...]


class RadixIndex(Generic[K]):
    def __init__(self) -> None:
        self._root: _Node[K] = _Node()

    def add(self, tokens: Sequence[int], key: K) -> None:
        node = self._root
        node.below += 1
        rest: Tokens = tuple(tokens)
        while rest:
            edge = node.edges.get(rest[0])
            if edge is None:
                child: _Node[K] = _Node()
                node.edges[rest[0]] = (rest, child)
                node = child
                node.below += 1
                rest = ()
                break
            label, child = edge
            common = common_prefix_length(label, rest)
            if common < len(label):
                middle: _Node[K] = _Node(below=child.below)
                middle.edges[label[common]] = (label[common:], child)
                node.edges[rest[0]] = (label[:common], middle)
                child = middle
            node = child
            node.below += 1
            rest = rest[common:]
        node.keys.add(key)

    def remove(self, tokens: Sequence[int], key: K) -> bool:
        path = self._path(tuple(tokens))
        if path is None or key not in path[-1].keys:
            return False
        path[-1].keys.discard(key)
        for node in path:
            node.below -= 1
        self._prune(tuple(tokens))
        return True

    def match(self, query: Sequence[int]) -> PathMatch[K]:
        node = self._root
        prefixes: list[tuple[int, frozenset[K]]] = []
        depth = 0
        rest: Tokens = tuple(query)
        below: _Node[K] = node
        while True:
            if node.keys:
                prefixes.append((depth, frozenset(node.keys)))
            below = node
            if not rest or rest[0] not in node.edges:
                break
            label, child = node.edges[rest[0]]
            common = common_prefix_length(label, rest)
            depth += common
            below = child
            if common < len(label):
                break
            node, rest = child, rest[common:]
        shared_keys = tuple(islice(self._keys_under(below), MAX_SHARED_KEYS)) if depth else ()
        return PathMatch(prefixes=tuple(prefixes), shared_length=depth, keys_below_shared=shared_keys)

    def _keys_under(self, node: _Node[K]) -> Iterator[K]:
        """Depth first and lazy: a caller that stops after a few keys never touches the rest of a wide subtree."""
        yield from node.keys
        stack = [iter(node.edges.values())]
        while stack:
            edge = next(stack[-1], None)
            if edge is None:
                stack.pop()
                continue
            child = edge[1]
            yield from child.keys
            stack.append(iter(child.edges.values()))

    def _path(self, tokens: Tokens) -> list[_Node[K]] | None:
        node, rest, path = self._root, tokens, [self._root]
        while rest:
            edge = node.edges.get(rest[0])
            if edge is None or rest[: len(edge[0])] != edge[0]:
                return None
            node, rest = edge[1], rest[len(edge[0]) :]
            path.append(node)
        return path

    def _prune(self, tokens: Tokens) -> None:
        """Drop empty branches along `tokens` so memory follows the stored vectors."""
        node, rest = self._root, tokens
        while rest:
            edge = node.edges.get(rest[0])
            if edge is None:
                return
            label, child = edge
            if child.below == 0:
                del node.edges[rest[0]]
                return
            node, rest = child, rest[len(label) :]
