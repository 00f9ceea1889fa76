"""Token dropping (placeholder while it is being written: the helper session replaces this)."""

from jaxaccel.errors import ConfigError


def validate(cfg):
    if not 0.0 < cfg.token_keep <= 1.0:
        raise ConfigError(f"token_keep must be in (0, 1], got {cfg.token_keep}",
                          field="model.token_keep")


def has_buffer(cfg) -> bool:
    return cfg.token_keep < 1.0 and cfg.token_drop_score == "loss"


def update_buffer(params, stats, cfg):
    raise NotImplementedError
