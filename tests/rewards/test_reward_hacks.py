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
    # a line nested past the parser's recursion limit, first on the channel
    "forge_a_deeply_nested_line": textwrap.dedent("""\
        import os
        os.write(3, b'[' * 200000 + b'\\n' + b'{"test": 0, ' * 100000 + b'\\n')
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


# hacks that reach what the test itself computes: each with the tests it attacks (none of
# which a constant passes); before the checker kept the test's side out of the program's
# process, the first three scored 0.33 to 1 (patching sorted alone never worked)
TARGETED = {
    # the program defines its own error but raises the built-in base: a test that expects its
    # own error must not take the base for it
    "raises_the_base_not_its_own_error": (textwrap.dedent("""\
        class NegativeError(ValueError):
            pass
        def check(n):
            raise ValueError(n)
        """), ["try:\n    check(-1)\nexcept NegativeError:\n    pass\nexcept Exception:\n"
               "    assert False"]),
    # the test's values were sent into the sandbox as setup code: the expected value sat in
    # the probe's frame, or anywhere in the process for the garbage collector to find
    "read_the_callers_frame": (textwrap.dedent("""\
        import gc, sys
        def f(x):
            for depth in range(1, 8):
                try:
                    frame = sys._getframe(depth)
                except ValueError:
                    break
                for space in (frame.f_locals, frame.f_globals):
                    for key in ("y", "expected", "cases"):
                        if key in space:
                            found = space[key]
                            return found[x] if isinstance(found, dict) else found
            for thing in gc.get_objects():
                if isinstance(thing, dict) and thing.get(1) == 2 and thing.get(5) == 6:
                    return thing[x]
            return None
        """), ["x, y = 1, 2\nassert f(x) == y", "x = 5\nexpected = 6\nassert f(x) == expected",
               "cases = {1: 2, 5: 6}\nassert f(1) == cases[1] and f(5) == cases[5]"]),
    # a helper the test defines ran in the program's namespace, where the program defined it first
    "define_the_tests_helper_first": (textwrap.dedent("""\
        def is_sorted(xs):
            return True
        def f(xs):
            return [9, 1, 0]
        """), ["def is_sorted(xs):\n    return list(xs) == sorted(xs)\n"
               "assert is_sorted(f([3, 1, 2])) and len(f([3, 1, 2])) == 3"]),
    # a standard-library call on the expected side ran where the program could replace it
    "replace_the_expected_sides_module": (textwrap.dedent("""\
        import datetime
        datetime.date = lambda *args: None
        def f(x):
            return None
        """), ["assert f(1) == datetime.date(2020, 1, 2)", "import datetime\n"
               "assert f(2) == datetime.date(2020, 1, 3)"]),
    # only sorted patched: the trusted side sorts with Python's own
    "patch_sorted_only": (textwrap.dedent("""\
        import builtins
        builtins.sorted = lambda *args, **kwargs: [2, 6]
        def f(x):
            return 0
        """), ["assert sorted([f(1), f(5)]) == [2, 6]"]),
}


@pytest.mark.parametrize("name", sorted(TARGETED))
def test_a_hack_on_the_tests_own_values_scores_zero(name, available):
  program, tests = TARGETED[name]
  result = sandbox.code_reward(f"```python\n{program}\n```", {"tests": tests},
                               CodeOptions(timeout_s=3.0))
  assert result["reward"] == 0.0 and not result["correct"], (name, result)


# honest programs in the forms tests take: each must score 1 (every test passes)
HONEST_PROGRAM = textwrap.dedent("""\
    import collections, datetime, fractions, sys
    Point = collections.namedtuple("Point", ["x", "y"])
    class NegativeError(ValueError):
        pass
    def sort_list(xs): return sorted(xs)
    def sort_in_place(xs): xs.sort()
    def check(n):
        if n < 0:
            raise NegativeError(n)
        return n
    def counts(text): return collections.Counter(text)
    def point(x, y): return Point(x, y)
    def gen(n):
        yield from range(n)
    def root(n): return complex(0, abs(n) ** 0.5) if n < 0 else n ** 0.5
    def half(n): return fractions.Fraction(n, 2)
    def big(n): return "x" * n
    def power(a, b): return a ** b
    def day(y, m, d): return datetime.date(y, m, d)
    def square(x): return x * x
    def double_all(xs): return [2 * x for x in xs]
    def hog(mb): return len(bytearray(mb * 2**20))
    def add(a, b): return a + b
    def push(xs, v): xs.append(v)
    class Counter:
        def __init__(self, start=0):
            self.n = start
        def inc(self):
            self.n += 1
            return self.n
        def chain(self):
            self.n *= 10
            return self
    if __name__ == "__main__":
        n = int(input())
        print(square(n))
    """)
HONEST_TESTS = [
    "def is_sorted(xs):\n    return all(a <= b for a, b in zip(xs, xs[1:]))\n"
    "assert is_sorted(sort_list([3, 1, 2]))",
    "a = [3, 1, 2]\nsort_in_place(a)\nassert a == [1, 2, 3]",
    "try:\n    check(-1)\n    assert False\nexcept ValueError:\n    pass",
    "try:\n    check(-1)\nexcept NegativeError:\n    pass\nexcept Exception:\n    assert False",
    "assert check(3) == 3",
    "assert counts('aab') == {'a': 2, 'b': 1}",
    "assert counts('aab').most_common(1) == [('a', 2)]",
    "assert point(1, 2) == (1, 2) and point(1, 2).x == 1",
    "assert list(gen(3)) == [0, 1, 2]",
    "g = gen(3)\nassert next(g) == 0\nassert next(g) == 1",
    "assert root(-4) == 2j",
    "from fractions import Fraction\nassert half(3) == Fraction(3, 2)",
    "assert len(big(100000)) == 100000",
    "assert power(10, 5000) == 10 ** 5000",
    "assert day(2020, 1, 1) == datetime.date(2020, 1, 1)",
    "x, y = 3, 9\nassert square(x) == y",
    "r = square(3)\nassert square(r) == 81",
    "cases = [(1, 1), (4, 16)]\nassert square(cases[1][0]) == cases[1][1]",
    "def inputs():\n    return [1, 2, 3]\nassert double_all(inputs()) == [2, 4, 6]",
    "assert double_all([v for v in range(3)]) == [0, 2, 4]",
    "assert hog(64) == 64 * 2**20",
    # HumanEval's form: the checks in a function, called with the entry point
    "METADATA = {'author': 'x'}\n\ndef check(candidate):\n    assert candidate(1, 2) == 3\n"
    "    assert candidate(-1, 1) == 0\n\ncheck(add)",
    # a class with state, its methods called in sequence (one returns the object itself)
    "c = Counter(2)\nc.inc()\nc.chain()\nassert c.inc() == 31\nassert c.n == 31",
    # the program mutates its argument; the test reads it through another name
    "xs = [1]\nys = xs\npush(xs, 2)\nassert ys == [1, 2] and xs is ys",
    "xs = [1]\nys = xs\npush(xs, 2)\nassert all(v > 0 for v in ys) and len(ys) == 2",
]


def test_honest_programs_in_every_form_a_test_takes_score_one(available):
  result = sandbox.run_tests(HONEST_PROGRAM, sandbox.normalize_tests(HONEST_TESTS),
                             timeout_s=10.0)
  failed = [test for test, ok in zip(HONEST_TESTS, result.passed) if not ok]
  assert not failed, failed


def test_a_wrong_program_fails_the_new_forms(available):
  """The forms above judge: a program that gets them wrong scores 0 on each."""
  wrong = (HONEST_PROGRAM.replace("return a + b", "return a - b")
           .replace("self.n += 1", "self.n += 2").replace("xs.append(v)", "xs = xs + [v]"))
  tests = HONEST_TESTS[-4:]
  result = sandbox.run_tests(wrong, sandbox.normalize_tests(tests), timeout_s=10.0)
  assert not any(result.passed), list(zip(tests, result.passed))


def test_a_test_that_captures_printed_output_is_refused_at_start_with_the_reason():
  test = ("import io, contextlib\nbuf = io.StringIO()\nwith contextlib.redirect_stdout(buf):\n"
          "    greet('bob')\nassert buf.getvalue() == 'hello bob\\n'")
  with pytest.raises(ValueError, match="captures what the program prints.*input/output pair"):
    sandbox.check_rows([{"tests": [test], "where": "row 3"}], CodeOptions())


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


def _probed(plan, namespace):
  """The probes' values and after-values as the sandbox would compute them, here: the test's
  inputs as the trusted side sends them (literals), then each probe in order."""
  local = dict(namespace)
  for name, value in checker.arguments(plan).items():
    local[name] = eval(checker.literal(value), dict(checker.LITERAL_MODULES))  # noqa: S307
  values, afters = [], []
  for k, (probe, names) in enumerate(zip(plan.probes, plan.named)):
    for name, j in plan.aliases.items():
      if j < k:
        local[name] = values[j]
    try:
      values.append(eval(probe, local))  # noqa: S307
    except Exception as error:  # noqa: BLE001
      values.append(checker.Raised(type(error).__name__,
                                   tuple(c.__name__ for c in type(error).__mro__)))
    afters.append({name: local[name] for name in names})
  return values, afters


@pytest.mark.parametrize("test", CHECKS)
def test_the_trusted_verdict_equals_python_running_the_assert(test):
  """The probes' values computed here (as the sandbox would), then the verdict three ways:
  Python running the test against the program, the trusted evaluator, and the code the
  second sandbox would run (the values written in as literals)."""
  namespace = {"__name__": "solution"}
  exec(PROGRAM, namespace)  # noqa: S102 - our own program
  try:
    exec(f"import math\n{test}", dict(namespace))  # noqa: S102
    expected = True
  except AssertionError:
    expected = False
  plan = checker.plan_asserts(test)
  values, afters = _probed(plan, namespace)
  verdict = checker.evaluate(plan, values, afters)
  assert verdict in (expected, None), (test, plan.probes)
  rendered = checker.render(plan, values, afters)
  assert not any(probe in rendered for probe in plan.probes), rendered  # no call of the program
  try:
    exec(f"import math\n{rendered}", {})  # noqa: S102 - literals only
    held = True
  except AssertionError:
    held = False
  assert held == expected, rendered


def test_a_probe_never_carries_the_expected_value():
  plan = checker.plan_asserts("expected = [9, 9]\nx = 3\nassert f(x) == expected")
  assert plan.probes == ["f(x)"] and plan.named == [["x"]] and plan.setup == "x = 3"
  assert checker.arguments(plan) == {"x": 3}
  plan = checker.plan_asserts("assert math.isclose(f(2), 1.41, rel_tol=1e-3)")
  assert plan.probes == ["f(2)"]
  # a value the test binds reaches the program only as the argument it is, never as code
  plan = checker.plan_asserts("x, y = 3, 9\nassert f(x) == y")
  assert plan.probes == ["f(x)"] and checker.arguments(plan) == {"x": 3}
  plan = checker.plan_asserts("cases = {1: 2, 5: 6}\nassert f(1) == cases[1]")
  assert plan.probes == ["f(1)"] and plan.setup == "" and checker.arguments(plan) == {}
  plan = checker.plan_asserts("cases = [(1, 2), (5, 6)]\nassert f(cases[0][0]) == cases[0][1]")
  assert plan.probes == ["f(_rlx_arg_0)"] and checker.arguments(plan) == {"_rlx_arg_0": 1}
  # what the test defines or evaluates on the expected side stays on the trusted side
  plan = checker.plan_asserts("def is_sorted(xs):\n    return xs == sorted(xs)\n"
                              "assert is_sorted(f(3))")
  assert plan.probes == ["f(3)"]
  plan = checker.plan_asserts("assert f(1) == datetime.date(2020, 1, 1)")
  assert plan.probes == ["f(1)"] and plan.imports == ["datetime"]
  with pytest.raises(checker.UnsupportedTest, match="one assert per input"):
    checker.plan_asserts("for x, y in [(1, 2)]:\n    assert f(x) == y")
  with pytest.raises(checker.UnsupportedTest, match="its own function"):
    checker.plan_asserts("def key(v):\n    return -v\nassert f([1, 2], key) == [2, 1]")


def test_the_decoder_takes_plain_data_only():
  assert checker.decode({"list": [{"int": "1"}, {"tuple": [{"str": "a"}, None]}]}) == [1, ("a", None)]
  assert checker.decode({"float": "nan"}) != checker.decode({"float": "nan"})
  for bad in ({"object": 1}, {"int": "1; import os"}, {"float": "1e5x"}, {"int": 1},
              {"set": [{"list": []}]}, [1], {"bool": 1}):
    with pytest.raises((ValueError, TypeError)):
      checker.decode(bad)
