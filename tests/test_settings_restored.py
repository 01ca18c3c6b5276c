"""Runs last (conftest.py sorts it there): the suite leaves torch's compiler settings as it found them.

A test that changes an option of torch._dynamo.config, torch._inductor.config or torch.fx.experimental._config
must do it through the module's own `patch`, which restores the value. pytest's monkeypatch does not: from
pytest 9.1 its undo deletes an attribute it did not find in the module's `__dict__`, and torch's config
modules keep their options elsewhere, so `error_on_recompile` vanished for every later test."""
import warnings

from conftest import SETTINGS_AT_START, TORCH_CONFIGS


def test_torch_compiler_settings_are_as_the_suite_found_them() -> None:
    """Catches an option deleted (monkeypatch's undo on a config module) or left changed by a test."""
    warnings.simplefilter("ignore", FutureWarning)  # reading a deprecated option warns; pytest restores filters
    for name, module in TORCH_CONFIGS.items():
        missing = [option for option in SETTINGS_AT_START[name] if not hasattr(module, option)]
        assert missing == [], f"{name}: options deleted by a test: {missing}"
        now = module.get_config_copy()
        changed = {option: (value, now[option]) for option, value in SETTINGS_AT_START[name].items()
                   if now[option] != value}
        assert changed == {}, f"{name}: options left changed (at start, now): {changed}"
