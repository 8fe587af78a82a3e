"""Lightning CLI with lightning_ort: configure ONNX Runtime training from YAML or the command line.

python examples/cli_train.py fit --config examples/cli_config.yaml
python examples/cli_train.py fit --trainer.strategy=ort_ddp --trainer.devices=2 --trainer.max_steps=20
python examples/cli_train.py fit --trainer.callbacks+=lightning_ort.ORTCallback --trainer.max_steps=20
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningCLI
from lit_lm import LitTransformerLM, SyntheticTokens

import lightning_ort  # noqa: F401  (registers "ort", "ort_ddp", "ort_ddp_spawn", "ort_fsdp" for --trainer.strategy)


def main() -> None:
    LightningCLI(LitTransformerLM, SyntheticTokens, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
