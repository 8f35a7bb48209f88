"""tests/conftest.py's OwnWarnings: a warning issued in selective_ckpt's source fails the test that got it, wherever
`stacklevel` attributes it; pytest.warns takes the ones a test expects; other warnings pass on to pytest's record."""

import textwrap

import pytest

pytest_plugins = ("pytester",)

# each inner test warns from code compiled under the file name given, as the source there would
INNER = """
import warnings

import numpy as np
import pytest

def issue(filename, source):
    exec(compile(source, filename, "exec"), {"warnings": warnings, "np": np})

def test_plain_warn():
    issue(OURS, "warnings.warn('from the package', UserWarning)")

def test_warning_addressed_to_the_caller():
    issue(OURS, "def f():\\n    warnings.warn('for the caller', UserWarning, stacklevel=3)\\nf()")

def test_warning_from_c_called_by_the_package():
    issue(OURS, "np.float32(3e38) * np.float32(10)")

def test_expected_warning():
    with pytest.warns(UserWarning, match="expected"):
        issue(OURS, "warnings.warn('expected', UserWarning)")

def test_filtered_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        issue(OURS, "warnings.warn('not shown', UserWarning)")

def test_third_party_warning():
    issue(THEIRS, "warnings.warn('from elsewhere', UserWarning)")

@pytest.fixture
def warns_in_setup():
    issue(OURS, "warnings.warn('in a fixture', UserWarning)")

def test_in_setup(warns_in_setup):
    pass
"""


@pytest.fixture
def inner(pytester, request):
    """Runs INNER in-process under a fresh OwnWarnings of the suite's own kind, its roots the suite's own
    (their files need not exist: the guard reads only their names)."""
    guard = request.config.pluginmanager.get_plugin("selective_ckpt-own-warnings")
    assert guard is not None, "tests/conftest.py registers the guard in pytest_configure"
    root = guard.roots[0]
    pytester.makepyfile(test_inner=f"OURS = {root + 'probe.py'!r}\nTHEIRS = {str(pytester.path / 'other.py')!r}\n"
                                   + textwrap.dedent(INNER))
    return pytester.runpytest_inprocess("-p", "no:randomly", "-p", "no:cacheprovider", "-rw",
                                        plugins=[type(guard)(guard.roots)])


def test_warnings_from_the_package_fail_the_test(inner):
    outcomes = {r.nodeid.split("::")[-1]: r for r in inner.reprec.getreports("pytest_runtest_logreport")
                if r.failed or r.when == "call"}
    failed = {name for name, r in outcomes.items() if r.failed}
    assert failed == {"test_plain_warn", "test_warning_addressed_to_the_caller",
                      "test_warning_from_c_called_by_the_package", "test_in_setup"}
    for name in failed:
        assert "selective_ckpt warned" in str(outcomes[name].longrepr), name
    assert "for the caller" in str(outcomes["test_warning_addressed_to_the_caller"].longrepr)
    assert "overflow" in str(outcomes["test_warning_from_c_called_by_the_package"].longrepr)


def test_other_warnings_reach_pytest_record(inner):
    """Every warning the filters let through is in pytest's record (the package's too, beside the failure);
    those pytest.warns took and those a filter dropped are not."""
    said = [str(call.warning_message.message) for call in inner.reprec.getcalls("pytest_warning_recorded")]
    assert "from elsewhere" in said and "from the package" in said
    assert "expected" not in said and "not shown" not in said


def test_the_guard_watches_the_package_source(request):
    import selective_ckpt.models

    guard = request.config.pluginmanager.get_plugin("selective_ckpt-own-warnings")
    assert guard.issued_here(selective_ckpt.__file__) and guard.issued_here(selective_ckpt.models.__file__)
    assert not guard.issued_here(pytest.__file__) and not guard.issued_here(__file__)
