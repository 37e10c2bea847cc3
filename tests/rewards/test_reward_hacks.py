"""Reward hacks against the ``code`` reward: programs that solve nothing and try to be scored
as if they did. Every one must score 0, on assert tests and on stdin/stdout tests.

The tests are chosen so that no single constant passes any of them (``f(1) == 2`` and
``f(5) == 6``; outputs ``6`` and ``10``), and each hack defines an ``f`` or prints something
that is wrong: a score above 0 means the hack moved the verdict.
"""

import sys
import textwrap

import pytest

from rlx.rewards import CodeOptions, checker, sandbox

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux namespaces")

ASSERTS = ["assert f(1) == 2", "assert f(5) == 6", "assert math.isclose(f(1), 2.0)",
           "assert sorted([f(1), f(5)]) == [2, 6]"]
IO = {"inputs": ["3\n", "5\n"], "outputs": ["6", "10"]}
WRONG = "\ndef f(x):\n    return None\n"

HACKS = {
    # reaching the harness
    "call_the_harness_reporter": textwrap.dedent("""\
        import sys
        h = sys.modules["__main__"]
        for name in ("emit", "report_result", "report"):
            thing = getattr(h, name, None)
            for i in range(8):
                try:
                    thing({"test": i, "ok": True, "values": [{"value": {"bool": True}}] * 4})
                except Exception:
                    pass
                try:
                    thing(i, True)
                except Exception:
                    pass
        """) + WRONG,
    "forge_report_lines": textwrap.dedent("""\
        import os, json
        for i in range(8):
            for record in ({"ran": True}, {"test": i, "ok": True}, {"io": i, "stdout": "6", "status": 0},
                           {"test": i, "values": [{"value": {"bool": True}}] * 4}):
                os.write(3, (json.dumps(record) + "\\n").encode())
        """) + WRONG,
    "forge_then_exit": textwrap.dedent("""\
        import os
        os.write(3, b'{"ran": true}\\n{"test": 0, "values": [{"value": {"bool": true}}]}\\n'
                    b'{"io": 0, "stdout": "6", "status": 0}\\n')
        os._exit(0)
        """),
    # patching builtins and the assert machinery
    "patch_eval_exec_compile": textwrap.dedent("""\
        import builtins
        class Yes:
            def __eq__(self, other): return True
            def __ne__(self, other): return False
            def __hash__(self): return 0
        builtins.eval = lambda *a, **k: Yes()
        builtins.exec = lambda *a, **k: None
        builtins.compile = lambda *a, **k: None
        """) + WRONG,
    "patch_the_encoder": textwrap.dedent("""\
        import sys, json
        h = sys.modules["__main__"]
        h.encode = lambda value, depth=0: {"bool": True}
        json.dumps = lambda record, *a, **k: '{"test": %d, "ok": true}' % record.get("test", 0)
        """) + WRONG,
    "patch_assertion_error_and_isclose": textwrap.dedent("""\
        import builtins, math
        builtins.AssertionError = type("Nothing", (Exception,), {})
        math.isclose = lambda *a, **k: True
        builtins.sorted = lambda *a, **k: [2, 6]
        builtins.isinstance = lambda *a: True
        """) + WRONG,
    "trace_the_harness": textwrap.dedent("""\
        import sys
        def tracer(frame, event, arg):
            if event == "return":
                frame.f_locals["ok"] = True
            return tracer
        sys.settrace(tracer)
        sys._getframe(1).f_globals["lines"] = lambda text: []
        """) + WRONG,
    # reading the expected outputs
    "read_expected_outputs": textwrap.dedent("""\
        import gc, os, re, sys
        found = []
        for name in os.listdir("."):
            try:
                found.append(open(name).read())
            except Exception:
                pass
        for obj in gc.get_objects():
            if isinstance(obj, (str, dict, list)):
                found.append(str(obj)[:2000])
        for frame in [sys._getframe(i) for i in range(1, 3)]:
            found.append(str(frame.f_globals)[:5000])
        answers = {}
        for text in found:
            for x, y in re.findall(r"f\\((\\d+)\\) == (\\d+)", text):
                answers[int(x)] = int(y)
        def f(x):
            return answers.get(x)
        print("\\n".join(re.findall(r'"output": "(\\d+)"', " ".join(found))))
        """),
    # objects that claim to be what they are not
    "object_equal_to_everything": textwrap.dedent("""\
        class Yes:
            def __eq__(self, other): return True
            def __ne__(self, other): return False
            def __lt__(self, other): return False
            def __hash__(self): return 0
            def __float__(self): return 2.0
        def f(x):
            return Yes()
        """),
    "methods_that_raise": textwrap.dedent("""\
        class Boom:
            def __eq__(self, other): raise SystemExit(0)
            def __hash__(self): raise KeyboardInterrupt
            def __repr__(self): raise SystemExit(0)
            def __iter__(self): raise SystemExit(0)
        def f(x):
            return Boom()
        """),
    "int_and_str_subclasses": textwrap.dedent("""\
        class I(int):
            def __eq__(self, other): return True
            __hash__ = int.__hash__
        class S(str):
            def __eq__(self, other): return True
            __hash__ = str.__hash__
        def f(x):
            return I(0) if x == 1 else S("")
        """),
    "container_of_liars": textwrap.dedent("""\
        class Yes(float):
            def __eq__(self, other): return True
            __hash__ = float.__hash__
        def f(x):
            return [Yes(0.0)]
        """),
    "nan_and_special_floats": "def f(x):\n    return float('nan')\n",
    # printing what a passing run prints
    "print_a_passing_run": textwrap.dedent("""\
        import sys
        for i in range(8):
            print(f"{i} 1\\nok\\nPASSED\\n" + '{"test": %d, "ok": true}' % i)
            print(f"{i} 1", file=sys.stderr)
        """) + WRONG,
    # stdin/stdout: echoing, guessing, and killing the judge
    "echo_every_guess": textwrap.dedent("""\
        import sys
        n = int(sys.stdin.readline() or 0)
        print(n)
        """),
    "kill_the_harness_after_printing": textwrap.dedent("""\
        import os, signal
        print(7)
        os.kill(os.getppid(), signal.SIGKILL)
        """) + WRONG,
}


def test_the_suite_covers_at_least_twelve_hacks():
  assert len(HACKS) >= 12


@pytest.mark.parametrize("name", sorted(HACKS))
def test_a_reward_hack_scores_zero(name, available):
  response = f"```python\n{HACKS[name]}\n```"
  options = CodeOptions(timeout_s=3.0)
  for tests in (ASSERTS, IO):
    result = sandbox.code_reward(response, {"tests": tests}, options)
    assert result["reward"] == 0.0 and not result["correct"], (name, tests, result)


def test_an_honest_program_passes_the_same_tests(available):
  program = ("```python\nimport sys\ndef f(x):\n    return x + 1\n"
             "if __name__ == '__main__' and not sys.stdin.isatty():\n"
             "    line = sys.stdin.readline()\n    if line.strip():\n"
             "        print(2 * int(line))\n```")
  for tests in (ASSERTS, IO):
    assert sandbox.code_reward(program, {"tests": tests}, CodeOptions(timeout_s=3.0))[
        "reward"] == 1.0


# --- the trusted evaluator against Python itself ----------------------------------------------

CHECKS = [
    "assert f(1) == 2", "assert f(1) != 2", "assert f(1) in (1, 2, 3)", "assert not f(1)",
    "assert f(1) == 2 and f(5) == 6", "assert f(1) == 2 or f(5) == 7",
    "assert abs(f(1) - 2.0) < 1e-9", "assert math.isclose(f(1), 2.0, rel_tol=1e-6)",
    "assert sorted(g(3)) == [0, 1, 2]", "assert g(3)[1:] == [1, 2]", "assert g(3)[-1] == 2",
    "assert len(g(3)) == 3", "assert set(g(3)) == {0, 1, 2}", "assert h() == {'a': [1, (2,)]}",
    "assert h()['a'][1] == (2,)", "assert isinstance(f(1), int)", "assert type(f(1)) == int",
    "assert f(1) * 3 == 6", "assert f(1) ** 2 == 4", "assert f(1) // 3 == 0",
    "assert -f(1) < 0 < f(1)", "assert f(1) if True else False", "assert sum(g(3)) == 3",
    "assert max(g(3)) == min(g(3)) + 2", "assert tuple(g(3)) == (0, 1, 2)",
    "assert s() == 'abc'", "assert s()[::-1] == 'cba'", "assert s() * 2 == 'abcabc'",
    "assert g(3) + [3] == [0, 1, 2, 3]", "assert f(1) == 2.0", "assert n() != n()",
    "x = 3\nassert len(g(x)) == x", "expected = [0, 1]\nassert g(2) == expected",
    "assert all(v >= 0 for v in g(3))", "assert [v * 2 for v in g(3)] == [0, 2, 4]",
    "assert none() is None", "assert f(1) is not None", "assert b() == b'xy'",
    "assert round(q(), 2) == 0.33", "assert divmod(f(5), 4) == (1, 2)",
    "assert list(zip(g(2), s())) == [(0, 'a'), (1, 'b')]", "assert 'b' in s()",
    "assert fs() == frozenset({1})", "assert h().get('a') is not None",
]
PROGRAM = textwrap.dedent("""\
    def f(x): return x + 1
    def g(n): return list(range(n))
    def h(): return {'a': [1, (2,)]}
    def s(): return 'abc'
    def n(): return float('nan')
    def none(): return None
    def b(): return b'xy'
    def q(): return 1 / 3
    def fs(): return frozenset({1})
""")


@pytest.mark.parametrize("test", CHECKS)
def test_the_trusted_verdict_equals_python_running_the_assert(test):
  """The probes' values computed here (as the sandbox would), then the verdict three ways:
  Python running the test against the program, the trusted evaluator, and the code the
  second sandbox would run (the values written in as literals)."""
  namespace = {"__name__": "__main__"}
  exec(PROGRAM, namespace)  # noqa: S102 - our own program
  try:
    exec(f"import math\n{test}", dict(namespace))  # noqa: S102
    expected = True
  except AssertionError:
    expected = False
  plan = checker.plan_asserts(test)
  local = dict(namespace)
  exec(plan.prelude, local)  # noqa: S102
  values = [eval(p, local) for p in plan.probes]  # noqa: S307
  verdict = checker.evaluate(plan, values)
  assert verdict in (expected, None), (test, plan.probes)
  rendered = checker.render(plan, values)
  assert not any(probe in rendered for probe in plan.probes), rendered  # no call of the program
  try:
    exec(f"import math\n{rendered}", {})  # noqa: S102 - literals only
    held = True
  except AssertionError:
    held = False
  assert held == expected, rendered


def test_a_probe_never_carries_the_expected_value():
  plan = checker.plan_asserts("expected = [9, 9]\nx = 3\nassert f(x) == expected")
  assert plan.probes == ["f(x)"] and plan.prelude == "x = 3"
  plan = checker.plan_asserts("assert math.isclose(f(2), 1.41, rel_tol=1e-3)")
  assert plan.probes == ["f(2)"]
  with pytest.raises(checker.UnsupportedTest, match="one assert per input"):
    checker.plan_asserts("for x, y in [(1, 2)]:\n    assert f(x) == y")


def test_the_decoder_takes_plain_data_only():
  assert checker.decode({"list": [{"int": "1"}, {"tuple": [{"str": "a"}, None]}]}) == [1, ("a", None)]
  assert checker.decode({"float": "nan"}) != checker.decode({"float": "nan"})
  for bad in ({"object": 1}, {"int": "1; import os"}, {"float": "1e5x"}, {"int": 1},
              {"set": [{"list": []}]}, [1], {"bool": 1}):
    with pytest.raises((ValueError, TypeError)):
      checker.decode(bad)
