"""The bits heatmap draws on a canvas of its own: a notebook's backend and figures stay as they were."""

import matplotlib
import matplotlib.pyplot as plt
from lightning_act.monitor import bits_heatmap


def test_heatmap_leaves_the_backend_and_pyplot_alone():
    previous = matplotlib.get_backend()
    matplotlib.use("svg")  # a backend the heatmap does not use itself
    try:
        figures = plt.get_fignums()
        image = bits_heatmap([{"fc1": 2.0, "fc2": 4.0}, {"fc1": 8.0, "fc2": 1.0}], [20, 40])
        assert matplotlib.get_backend() == "svg"
        assert plt.get_fignums() == figures
    finally:
        matplotlib.use(previous)
    assert image.ndim == 3 and image.shape[2] == 3 and image.dtype.name == "uint8", image.shape
    assert image.std() > 0, "a blank image"
