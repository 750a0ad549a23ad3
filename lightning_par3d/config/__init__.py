"""The par3d configuration: the settings (:mod:`~lightning_par3d.config.settings`), their one validation pass and
the layout it resolves (:mod:`~lightning_par3d.config.validate`, :mod:`~lightning_par3d.config.layout`), and the
vocabularies they are checked against (:mod:`~lightning_par3d.config.tp_vocabulary`,
:mod:`~lightning_par3d.config.schedules`). Plain Python, importing nothing of par3d's above it: every layer reads it."""

from lightning_par3d.config.layout import DATA_PARALLEL_ENGINES, Layout
from lightning_par3d.config.settings import (
    AC_MODES,
    COMPILE_OPTION_NAMES,
    GRAD_COMPRESSIONS,
    INIT_MODES,
    LAYOUT_MODES,
    LOSS_MEANS,
    ZERO_STAGES,
    Par3DConfig,
    changed_settings,
    config_from,
    explicit_settings,
    field_keywords,
    split_settings,
)
from lightning_par3d.config.validate import resolve_layout

__all__ = [
    "AC_MODES",
    "COMPILE_OPTION_NAMES",
    "DATA_PARALLEL_ENGINES",
    "GRAD_COMPRESSIONS",
    "INIT_MODES",
    "LAYOUT_MODES",
    "LOSS_MEANS",
    "ZERO_STAGES",
    "Layout",
    "Par3DConfig",
    "changed_settings",
    "config_from",
    "explicit_settings",
    "field_keywords",
    "resolve_layout",
    "split_settings",
]
