"""envs.py: the one reader of PAGEDLLM_* variables and its one boolean parser."""

import pytest

from pagedllm import envs
from pagedllm.config import KernelConfig


@pytest.mark.parametrize("text,value", [("0", False), ("false", False), ("OFF", False), ("no", False),
                                        ("1", True), ("True", True), ("on", True), ("yes", True)])
def test_one_boolean_parser(monkeypatch, text, value):
    for name in ("PAGEDLLM_CPU_KERNELS", "PAGEDLLM_FUSED_OPS", "PAGEDLLM_PLAIN_CONFIG"):
        monkeypatch.setenv(name, text)
        assert getattr(envs, name) is value


def test_unset_and_empty_give_the_default(monkeypatch):
    monkeypatch.delenv("PAGEDLLM_PDL", raising=False)
    assert envs.PAGEDLLM_PDL is True
    monkeypatch.setenv("PAGEDLLM_PDL", "")
    assert envs.PAGEDLLM_PDL is True
    monkeypatch.delenv("PAGEDLLM_API_KEY", raising=False)
    assert envs.PAGEDLLM_API_KEY is None


def test_a_typo_is_an_error_naming_the_variable(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_FOLD_NORMS", "nope")
    with pytest.raises(ValueError, match="PAGEDLLM_FOLD_NORMS"):
        KernelConfig.from_env()


def test_cache_dir_is_a_path(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    assert envs.PAGEDLLM_CACHE_DIR == tmp_path


def test_unknown_names_are_attribute_errors():
    with pytest.raises(AttributeError):
        envs.PAGEDLLM_NOT_A_VARIABLE  # noqa: B018


def test_kernel_config_reads_the_switches_once(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_GEMM_TUNING", "off")
    monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", "false")
    config = KernelConfig.from_env()
    monkeypatch.setenv("PAGEDLLM_GEMM_TUNING", "on")
    assert config.gemm_tuning is False and config.cpu_kernels is False


def test_no_other_module_reads_the_environment():
    import pathlib
    import re

    root = pathlib.Path(envs.__file__).parent
    offenders = []
    for path in root.rglob("*.py"):
        if path.name == "envs.py":
            continue
        text = path.read_text()
        if re.search(r"os\.environ\b|getenv\(", text):
            offenders.append(str(path.relative_to(root)))
    assert offenders == []
