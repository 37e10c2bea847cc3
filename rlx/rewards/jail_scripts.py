"""The scripts the code sandbox runs in its jails, as source: the harness that runs a program
against its tests and reports values and outputs (never a verdict), the check of asserts
beyond the trusted evaluator with the program's values written in, and the computation of a
test's own inputs; the last two hold no line of the program."""

from rlx.rewards import checker

OUTPUT_CAP = 64 * 1024  # bytes of stdout/stderr kept; a program that writes more is stopped

# Plain data out of a jail (``checker.decode`` reads it back): shared by the jails' scripts.
ENCODE = r'''
import collections, datetime, decimal, fractions, io, sys, types
sys.set_int_max_str_digits(0)
ITEMS = 10000  # of a generator or iterator the program returns

def encode(value, depth=0):
    kind = type(value)
    if depth > 64:
        raise ValueError("nested too deeply")
    if value is None:
        return None
    if kind in (bool, str):
        return {kind.__name__: value}
    if kind is int:
        return {"int": hex(value)}
    if kind is float:
        return {"float": repr(value)}
    if kind is complex:
        return {"complex": [repr(value.real), repr(value.imag)]}
    if kind is fractions.Fraction:
        return {"Fraction": [hex(value.numerator), hex(value.denominator)]}
    if kind is decimal.Decimal:
        return {"Decimal": str(value)}
    if kind is bytes:
        return {"bytes": value.hex()}
    if isinstance(value, tuple) and hasattr(kind, "_fields") and kind.__bases__ == (tuple,):
        return {"namedtuple": [kind.__name__, list(kind._fields),
                               [encode(item, depth + 1) for item in value]]}
    if kind in (list, tuple, set, frozenset, collections.deque):
        return {kind.__name__: [encode(item, depth + 1) for item in value]}
    if kind in (dict, collections.Counter, collections.OrderedDict, collections.defaultdict):
        name = "dict" if kind is collections.defaultdict else kind.__name__
        return {name: [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    if kind in (datetime.date, datetime.datetime, datetime.time):
        return {kind.__name__: value.isoformat()}
    if isinstance(value, type) and issubclass(value, BaseException):  # for an `except` clause
        return {"exception": [c.__name__ for c in value.__mro__]}
    if kind is datetime.timedelta:
        return {"timedelta": [hex(value.days), hex(value.seconds), hex(value.microseconds)]}
    if kind in (types.GeneratorType, map, filter, zip, enumerate, reversed) or (
            hasattr(value, "__next__") and hasattr(value, "__iter__")):
        items = []
        for item in value:
            items.append(encode(item, depth + 1))
            if len(items) >= ITEMS:
                break
        return {"iterator": items}
    raise TypeError("not plain data")

'''

# Runs in the jail. It reports values and outputs, never a verdict: the expected results are
# not here. The stdin/stdout tests run first, each in a fresh interpreter of its own (never
# this one); the program is loaded into this interpreter only after they are all reported.
HARNESS = r'''
import json, os, selectors, subprocess, sys
LITERAL_MODULES = {f"_rlx_{name}": __import__(name)
                   for name in ("collections", "fractions", "decimal", "datetime")}
with open("plan.json") as f:
    plan = json.load(f)
os.remove("plan.json")
report = os.fdopen(3, "w", buffering=1)
CAP = %d

def emit(record):
    report.write(json.dumps(record) + "\n")

def run_once(text):
    with open("stdin.txt", "w") as f:
        f.write(text)
    with open("stdin.txt") as stdin:
        child = subprocess.Popen([sys.executable, "-I", "-S", "-B", "main.py"], stdin=stdin,
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    os.set_blocking(child.stdout.fileno(), False)
    selector = selectors.DefaultSelector()
    selector.register(child.stdout, selectors.EVENT_READ)
    out = b""
    while len(out) <= CAP:
        selector.select(timeout=0.05)
        chunk = child.stdout.read() or b""
        out += chunk
        if child.poll() is not None and not chunk:
            break  # exited, and nothing more to read (a child it left may hold the pipe)
    child.kill()
    status = child.wait()
    return (out[:CAP].decode("utf-8", "replace"), status) if len(out) <= CAP else (None, status)

''' % OUTPUT_CAP + ENCODE + r'''
def raised(error):
    return {"error": type(error).__name__, "bases": [c.__name__ for c in type(error).__mro__]}

for index, text in plan["inputs"]:
    stdout, status = run_once(text)
    emit({"io": index, "stdout": stdout, "status": status})

if plan["probes"]:
    with open("main.py") as f:
        source = f.read()
    # imported, not run as a script: its `if __name__ == "__main__":` part (reading input) is not
    # a probe's business; stdin is empty
    namespace = {"__name__": "solution"}
    sys.stdin = io.StringIO("")
    os.close(0)
    try:
        exec(compile(source, "main.py", "exec"), namespace)
        emit({"ran": True})
    except BaseException:
        emit({"ran": False})
        namespace = None
    for index, arguments, aliases, probes in plan["probes"] if namespace else ():
        local = dict(namespace)
        results = []
        try:
            for name, literal in arguments.items():  # the test's values, as data: never code
                local[name] = eval(literal, dict(LITERAL_MODULES))
        except BaseException as error:
            results = [raised(error)] * len(probes)
        values = {}
        for k, (expression, names) in enumerate(probes[len(results):], start=len(results)):
            for name, j in aliases:
                if j < k and j in values:
                    local[name] = values[j]
            try:
                values[k] = eval(expression, local)
                result = {"value": encode(values[k])}
            except BaseException as error:
                result = raised(error)
            after = {}
            for name in names:
                try:
                    after[name] = encode(local[name])
                except BaseException:
                    pass
            result["after"] = after
            results.append(result)
        emit({"test": index, "values": results})
'''

# Runs in a second jail that holds no line of the program: assert tests the trusted evaluator
# does not cover, with the program's values written in as literals.
CHECK = r'''
import json, os
with open("checks.json") as f:
    checks = json.load(f)
report = os.fdopen(3, "w", buffering=1)
for name in %r:
    try:
        globals()[name] = __import__(name)
    except ImportError:
        pass
for index, code in checks:
    try:
        exec(code, dict(globals()))
        ok = True
    except BaseException:
        ok = False
    report.write(json.dumps({"test": index, "ok": ok}) + "\n")
''' % (checker.TRUSTED_MODULES,)

# Runs in a jail that holds no line of the program: the test's own inputs for the program
# where the trusted evaluator cannot compute them (a helper the test defines, a comprehension).
SETUP = ENCODE + r'''
import json, os
with open("setup.json") as f:
    jobs = json.load(f)
report = os.fdopen(3, "w", buffering=1)
for index, setup, names, anonymous, imports in jobs:
    space = {name: __import__(name) for name in imports}
    try:
        exec(setup, space)
        values = {name: encode(space[name]) for name in names}
        for m, source in enumerate(anonymous):
            values["_rlx_arg_%d" % m] = encode(eval(source, space))
        report.write(json.dumps({"test": index, "arguments": values}) + "\n")
    except BaseException as error:
        report.write(json.dumps({"test": index, "error": type(error).__name__}) + "\n")
'''
