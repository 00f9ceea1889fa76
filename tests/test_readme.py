"""The README's custom training loop runs as printed and trains."""

import os
import re

import numpy as np

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def test_the_readme_custom_loop_composes_the_transformations_and_trains(capsys):
    text = open(README).read()
    code = re.search(r"<!-- custom-loop -->\n```python\n(.*?)```", text, re.S).group(1)
    namespace = {}
    exec(compile(code, "README.md (custom loop)", "exec"), namespace)
    loss, loss_scale = namespace["loss"], namespace["loss_scale"]
    assert np.isfinite(float(loss)) and float(loss) < 4.0          # from ln(320) = 5.77 nats
    assert int(loss_scale.skipped_steps) < 5                       # a few overflows back off
    assert float(loss_scale.loss_scale) < 2.0**16                  # ... from the initial scale
    assert "steps skipped" in capsys.readouterr().out
