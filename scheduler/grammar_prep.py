"""Grammars compiled ahead on the executors. A constrained request starts on an executor only once
its grammar is compiled there (PrepareGrammar, asked when the request is queued there): compiling
a large schema takes the engine a tenth of a second to seconds, and on the step path it held up
every sequence of the executor for that long (five new 150 KB schemas stopped a plain stream's
tokens for 1-2 s). Meanwhile the request waits in its queue like one whose adapter is loading, and
the others go on. vLLM's requests wait for their grammar the same way (WAITING_FOR_FSM).

What each executor has compiled is remembered for as many grammars as it keeps compiled
(executor/grammar.py MAX_COMPILED, most recently used); one it has since dropped is compiled again
on its step path, which is correct, only slower. A preparation that fails (the executor restarted,
the call timed out) lets the request start anyway: the executor compiles it then.
"""

from collections.abc import Callable

from common.grammar import Grammar
from common.lru import Lru
from scheduler.executor_state import ExecutorState
from scheduler.request import Request

REMEMBERED = 256  # grammars per executor known compiled (executor/grammar.py MAX_COMPILED)


class GrammarPrep:
    def __init__(self, start: Callable[[ExecutorState, Grammar], None] | None,
                 wake: Callable[[], None]):
        """`start(ex, grammar)`: ask ex to compile it (its answer: `prepared`); None: no
        preparation, every grammar counts as ready (the executor compiles on its step path)."""
        self._start, self._wake = start, wake
        self._ready: dict[ExecutorState, Lru[Grammar, bool]] = {}
        self._pending: dict[ExecutorState, set[Grammar]] = {}

    def bring_closer(self, ex: ExecutorState, req: Request) -> None:
        """req was queued on ex: have its grammar, if any, compiled there."""
        self.is_ready(ex, req)

    def is_ready(self, ex: ExecutorState, req: Request) -> bool:
        """Whether req may start on ex as far as its grammar goes (asking ex to compile it when
        it is not, and not asked yet)."""
        grammar = req.ask.sampling.grammar
        if grammar is None or self._start is None:
            return True
        ready = self._ready.setdefault(ex, Lru(REMEMBERED))
        if ready.get(grammar):
            return True
        pending = self._pending.setdefault(ex, set())
        if grammar not in pending:
            pending.add(grammar)
            self._start(ex, grammar)
        return False

    def prepared(self, ex: ExecutorState, grammar: Grammar, ready: bool = True) -> None:
        """ex answered the preparation of `grammar`: `ready` (compiled, or failed for a reason
        of its own: it compiles it on its step path then), or not (it refused the grammar: the
        next request for it asks again)."""
        if ex not in self._pending:
            return  # (a view of ex forgotten since: it reconnected)
        self._pending[ex].discard(grammar)
        if ready:
            self._ready[ex].put(grammar, True)
        self._wake()

    def forget(self, ex: ExecutorState) -> None:
        self._ready.pop(ex, None)
        self._pending.pop(ex, None)
