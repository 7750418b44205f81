"""How `make test` splits the suite over its two xdist workers (tests/conftest.py): the
end-to-end tests in two serial groups, every other test a unit of its own."""

from __future__ import annotations

from tests.conftest import E2E_OWN_PLATFORM, REPO, xdist_scope


def test_e2e_tests_go_in_two_groups_and_the_rest_one_by_one() -> None:
    assert xdist_scope("tests/e2e/test_faults.py::test_x") == "e2e-platform"
    assert xdist_scope("tests/e2e/test_rl_job.py::test_y[2]") == "e2e-platform"
    assert xdist_scope("tests/e2e/test_chaos.py::test_z") == "e2e-own"
    assert xdist_scope("tests/unit/test_spec.py::test_a[e2e]") == "tests/unit/test_spec.py::test_a[e2e]"
    assert xdist_scope("tests/integration/test_cli.py::test_b") == "tests/integration/test_cli.py::test_b"


def test_every_module_named_as_starting_its_own_platform_exists() -> None:
    assert E2E_OWN_PLATFORM and all((REPO / "tests" / "e2e" / m).is_file() for m in E2E_OWN_PLATFORM)
