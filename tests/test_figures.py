"""Per-client figures stay bounded: FEDORA's similarity heat map at 1,000 clients asked for a
50,200 x 25,000 pixel canvas and ran the server out of memory (22 GB)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from common.figures import MAX_INCHES, inches, tick_step
from strategies.fedbasis import plot_coefficients
from strategies.fedora import plot_similarity


def test_sizes_and_ticks_are_bounded() -> None:
    assert inches(10, 0.25, 4.0) == 4.0 and inches(40, 0.25, 4.0) == 10.0 and inches(10_000, 0.25, 4.0) == MAX_INCHES
    assert tick_step(10) == 1 and tick_step(1000) == 25 and -(-1000 // tick_step(1000)) <= 40


def test_a_thousand_clients_plot_in_a_bounded_image(tmp_path: Path) -> None:
    num = 1000
    labels = [str(i) for i in range(num)]
    w = np.random.default_rng(0).random((num, num))
    plot_similarity(tmp_path / "similarity.png", w, w, labels, "paper")
    width, height = Image.open(tmp_path / "similarity.png").size
    assert width <= (MAX_INCHES + 2) * 100 and height <= MAX_INCHES * 100
    coefficients = {c: {"s1": [0.25, 0.75], "fc": [0.5, 0.5]} for c in labels}
    plot_coefficients(tmp_path / "coefficients.png", coefficients, {}, major=True)
    width, height = Image.open(tmp_path / "coefficients.png").size
    assert height <= (MAX_INCHES + 2) * 110
