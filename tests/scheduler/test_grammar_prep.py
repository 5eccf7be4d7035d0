"""A constrained request starts on an executor once its grammar is compiled there (PrepareGrammar,
scheduler/grammar_prep.py), the others going on meanwhile; an executor that refuses the grammar
fails the requests waiting for it; one that restarts compiles again."""

from common.errors import InvalidArgument, Unavailable
from common.grammar import Grammar, GrammarKind
from common.sampling import SamplingParams
from scheduler.request import ErrorEvent
from tests.scheduler.sched_world import World

WORDS = SamplingParams(grammar=Grammar(GrammarKind.REGEX, "[a-z]+"))
DIGITS = SamplingParams(grammar=Grammar(GrammarKind.REGEX, "[0-9]+"))


def started(w: World, *reqs) -> list[bool]:
    running = {seq.request for seq in w.running().values()}
    return [req in running or w.finished(req) for req in reqs]


def test_a_constrained_request_waits_for_its_grammar_and_nobody_waits_for_it():
    w = World(prepare_grammars=True)
    (ex,) = w.executors
    constrained = w.request(tenant="a", sampling=WORDS, max_new=20)
    plain = w.request(tenant="b", max_new=20)
    assert w.grammars_asked == [(ex, WORDS.grammar)]  # (asked as it was queued)
    w.step()
    assert started(w, constrained, plain) == [False, True]
    w.core.on_grammar_prepared(ex, WORDS.grammar)
    w.step()
    assert started(w, constrained) == [True]
    again = w.request(tenant="c", sampling=WORDS)  # compiled there: starts at once
    w.step()
    assert started(w, again) == [True] and len(w.grammars_asked) == 1
    w.run()
    assert all(w.finished(r) for r in (constrained, plain, again))


def test_a_refused_grammar_fails_its_requests_and_a_failed_compile_lets_them_start():
    w = World(prepare_grammars=True)
    (ex,) = w.executors
    refused = [w.request(tenant=t, sampling=WORDS) for t in ("a", "b")]
    w.core.on_grammar_prepared(ex, WORDS.grammar, InvalidArgument("grammar: does not compile"))
    for req in refused:
        assert any(isinstance(e, ErrorEvent) for e in w.events[req.serial])
    timed_out = w.request(sampling=DIGITS)
    w.core.on_grammar_prepared(ex, DIGITS.grammar, Unavailable("deadline exceeded"))
    w.run()  # (the executor compiles it on its step path)
    assert w.finished(timed_out)


def test_an_executor_that_restarts_compiles_again():
    w = World(prepare_grammars=True)
    w.request(sampling=WORDS)
    w.core.on_grammar_prepared(w.executors[0], WORDS.grammar)
    w.run()
    w.core.on_executor_lost(w.executors[0])
    w.executors[0] = w.core.add_executor("ex0", w.shape)
    later = w.request(sampling=WORDS)
    assert w.grammars_asked[-1] == (w.executors[0], WORDS.grammar) and len(w.grammars_asked) == 2
    w.step()
    assert started(w, later) == [False]
