"""RadixAttention's cache (SGLang, arXiv 2312.07104, §3): a radix tree from token-id runs to KV pages.

Every edge of the tree is a run of token ids whose length is a multiple of `page_size`; its value is the
list of KV pages (physical blocks of nano_vllm's pool) holding those tokens' K/V, one page per
`page_size` tokens. Page size 1 is the paper's (one KV slot per token); the engine uses nano_vllm's
block size, because its paged kernels want pages of ≥ 16 slots.

* `match_prefix(tokens)` walks the tree and returns the pages of the longest cached page-aligned prefix
  and the node where it ends; an edge matched only partly is *split* there (§3, Fig. 3), so the returned
  node always ends exactly at the match.
* `insert(tokens, pages)` adds a finished (or chunked) request's pages. Where the tree already holds the
  same tokens under other pages, the request's pages are duplicates: insert reports how many leading
  pages were already cached, and the caller frees its own copies (or re-points its table at the tree's).
* A lock counter on every node (`lock` / `unlock`, from a request's last node up to the root) marks what
  a running request reads: locked nodes are never evicted (§3: "reference counter").
* `evict(n)` frees at least n pages (when that many are evictable), least recently used *leaves* first;
  a parent whose last child goes becomes a leaf candidate itself (§3: "LRU eviction policy that
  recursively evicts leaf nodes"). Candidates sit in a heap that is maintained incrementally: a node is
  pushed when it becomes an unlocked leaf or is touched, and stale entries are skipped when popped.

The tree owns one reference on each page it holds (`pool.incref`), so the cache and running requests
share one pool (nano_vllm's `BlockPool`): a page leaves the pool's free list while anybody uses it, and
the cache shrinks (`evict`) when requests need room. Accounting: `pool.num_free + evictable_size +
protected_size + pages held only by requests == pool size`.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence as Seq

from nano_vllm.block_manager import BlockPool  # the tree needs only its incref / decref


class TreeNode:
    """A node of the radix tree: the edge into it (`key`, its token run, and `pages`, their KV pages) and
    its lock count (requests reading it or a descendant)."""

    _ids = itertools.count()

    __slots__ = ("children", "id", "key", "last_access", "lock_ref", "pages", "parent")

    def __init__(self, key: tuple[int, ...] = (), pages: list[int] | None = None,
                 parent: TreeNode | None = None):
        self.id = next(TreeNode._ids)
        self.key = key  # the token run on the edge into this node
        self.pages = pages if pages is not None else []
        self.parent = parent
        # keyed by the first page of the child's run
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.lock_ref = 0
        self.last_access = 0

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def __repr__(self) -> str:
        return (f"TreeNode(id={self.id}, len={len(self.key)}, lock={self.lock_ref}, "
                f"pages={self.pages})")


class RadixCache:
    """The radix tree over a shared page pool; see the module docstring."""

    def __init__(self, pool: BlockPool, page_size: int = 1):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.pool = pool
        self.page_size = page_size
        self.clock = itertools.count(1)  # logical time for LRU (deterministic, unlike wall time)
        self.reset()

    def reset(self) -> None:
        self.root = TreeNode()
        self.root.lock_ref = 1  # the root is never evicted
        self.evictable_size = 0  # pages in nodes with lock_ref == 0
        self.protected_size = 0  # pages in locked nodes
        self._heap: list[tuple[int, int, TreeNode]] = []
        self.num_nodes = 1

    # ------------------------------------------------------------------ lookup
    def _first(self, key: Seq[int], pos: int = 0) -> tuple[int, ...]:
        return tuple(key[pos: pos + self.page_size])

    def _common(self, key: tuple[int, ...], tokens: tuple[int, ...], pos: int) -> int:
        """Length of the common prefix of `key` and `tokens[pos:]`, rounded down to whole pages.

        Why not a token-by-token loop: this runs for every waiting request at every step (longest-prefix-
        match ordering) over prompts of thousands of tokens. Prefix equality is monotone in the length, so
        a binary search over whole pages with tuple comparisons (done in C) finds it in O(log n) of them."""
        ps = self.page_size
        n = min(len(key), len(tokens) - pos)
        if key[:n] == tokens[pos: pos + n]:
            return n - n % ps
        lo, hi = 0, n // ps  # pages: lo match, hi (or the remainder past it) does not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if key[: mid * ps] == tokens[pos: pos + mid * ps]:
                lo = mid
            else:
                hi = mid - 1
        return lo * ps

    def match_prefix(self, tokens: Seq[int]) -> tuple[list[int], TreeNode]:
        """Pages of the longest cached page-aligned prefix of `tokens`, and the node it ends at (an edge
        matched only partly is split there). Touches the path for LRU."""
        tokens = tuple(tokens[: len(tokens) - len(tokens) % self.page_size])
        node, pages, pos, now = self.root, [], 0, next(self.clock)
        # A partly matched edge ends the walk: the match is page-aligned, so the next page of `tokens`
        # differs from the first page of the split-off rest, the only child of the new node.
        while (pos < len(tokens)
               and (child := node.children.get(self._first(tokens, pos))) is not None):
            n = self._common(child.key, tokens, pos)
            if n < len(child.key):
                child = self._split(child, n)
            self._touch(child, now)
            pages += child.pages
            node, pos = child, pos + n
        return pages, node

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child`'s edge after n tokens; returns the new upper node (it inherits the lock count:
        whoever locked child locked every ancestor, and the new node is one)."""
        upper = TreeNode(child.key[:n], child.pages[: n // self.page_size], child.parent)
        upper.lock_ref, upper.last_access = child.lock_ref, child.last_access
        child.parent.children[self._first(child.key)] = upper
        child.key, child.pages = child.key[n:], child.pages[n // self.page_size:]
        child.parent = upper
        upper.children[self._first(child.key)] = child
        self.num_nodes += 1
        return upper

    def _touch(self, node: TreeNode, now: int) -> None:
        node.last_access = now
        if node.lock_ref == 0 and node.is_leaf:
            heapq.heappush(self._heap, (now, node.id, node))

    # ------------------------------------------------------------------ insert
    def insert(self, tokens: Seq[int], pages: Seq[int]) -> int:
        """Cache `pages` as holding the K/V of `tokens` (page-aligned; extra tokens past the last full page
        are ignored). Returns how many leading pages the tree already held (duplicates of the caller's);
        the rest hang below the matched node as a new leaf, and the tree takes a reference on each."""
        ps, n_pages = self.page_size, min(len(tokens) // self.page_size, len(pages))
        cached, node = self.match_prefix(tokens[: n_pages * ps])
        k = len(cached)
        if k < n_pages:
            new = TreeNode(tuple(tokens[k * ps : n_pages * ps]), list(pages[k:n_pages]), node)
            for p in new.pages:
                self.pool.incref(p)
            node.children[self._first(new.key)] = new
            self.num_nodes += 1
            self.evictable_size += len(new.pages)
            self._touch(new, next(self.clock))  # a new unlocked leaf: an eviction candidate at once
        return k

    # ------------------------------------------------------------------ locks
    def lock(self, node: TreeNode) -> None:
        """A request reads node's path: protect it from eviction (lock counts up to the root)."""
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.pages)
                self.protected_size += len(node.pages)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        """A request no longer reads node's path: count down to the root; unlocked leaves become
        eviction candidates."""
        now = next(self.clock)
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError(f"unlock of an unlocked node {node}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_size += len(node.pages)
                self.protected_size -= len(node.pages)
                self._touch(node, now)
            node = node.parent

    # ------------------------------------------------------------------ eviction
    def evict(self, num_pages: int) -> int:
        """Free at least `num_pages` pages, least recently used unlocked leaves first (fewer when not that
        many are evictable). Returns the number of pages released by the tree."""
        released = 0
        while released < num_pages and self._heap:
            stamp, _, node = heapq.heappop(self._heap)
            # a stale entry: touched, locked, grown or already gone since it was pushed
            if (node.parent is None or node.lock_ref > 0 or not node.is_leaf
                    or stamp != node.last_access
                    or node.parent.children.get(self._first(node.key)) is not node):
                continue
            for p in node.pages:
                self.pool.decref(p)
            released += len(node.pages)
            self.evictable_size -= len(node.pages)
            parent = node.parent
            del parent.children[self._first(node.key)]
            node.parent = None
            self.num_nodes -= 1
            if parent is not self.root and parent.lock_ref == 0 and parent.is_leaf:
                heapq.heappush(self._heap, (parent.last_access, parent.id, parent))
        if len(self._heap) > 4 * self.num_nodes + 64:  # drop stale entries now and then
            self._heap = [e for e in self._heap
                          if e[2].parent is not None and e[0] == e[2].last_access]
            heapq.heapify(self._heap)
        return released

    def clear(self) -> None:
        """Forget everything (after a failed step): release the tree's reference on every page. Locks held
        by running requests die with the tree; their owners must not unlock old nodes afterwards."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            for p in node.pages:
                self.pool.decref(p)
            node.parent = None
            stack.extend(node.children.values())
        self.reset()

    # ------------------------------------------------------------------ accounting
    def total_pages(self) -> int:
        return self.evictable_size + self.protected_size

    def path_len(self, node: TreeNode) -> int:
        n = 0
        while node is not self.root and node is not None:
            n += len(node.key)
            node = node.parent
        return n
