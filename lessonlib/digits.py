"""Real handwritten digits with no download, a small CNN and an atomic save (chapter 11).

    train, test = datasets("digits")                 # scikit-learn's bundled 1,797 8x8 digits
    train, test = datasets("mnist", data_dir="DIR")  # the MNIST files, if you have them
    model = small_cnn()                              # 1 channel in, 10 classes out, any image size
    save_atomic(state, path)                         # write to path.tmp, then rename: all or nothing

Chapter 11's three scripts (one process, mp.spawn, torchrun) share this pipeline, so the diffs
between them show only what distributed training changes. Every rank calls `datasets` and gets the
same split: it is drawn from a fixed seed, never from the global RNG. The random augmentation draws
from the global torch RNG of the process that applies it (a DataLoader worker, or the rank itself
with num_workers=0), which is why chapter 4 seeds each rank differently.
"""

import os

import torch
from torch import nn

TEST_SIZE = 357  # 1797 - 357 = 1440 training images: divisible by 1 to 6, so no rank gets padding
SPLIT_SEED = 0
MNIST_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


class Images(torch.utils.data.Dataset):
    """uint8 images (N, H, W) and integer labels, each image passed through `transform` when read."""

    def __init__(self, images, labels, transform):
        self.images, self.labels, self.transform = images, labels, transform

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.transform(self.images[i].unsqueeze(0)), self.labels[i]


def transforms(mean, std, augment):
    """torchvision v2: ToImage + ToDtype(scale=True) is v2's ToTensor; a small RandomAffine to train."""
    from torchvision.transforms import v2  # here: a process that only starts others need not import it

    steps = [v2.ToImage()]
    if augment:
        steps.append(v2.RandomAffine(degrees=10, translate=(0.1, 0.1)))
    steps += [v2.ToDtype(torch.float32, scale=True), v2.Normalize([mean], [std])]
    return v2.Compose(steps)


def bundled_digits():
    """scikit-learn's digits, (1797, 8, 8) values 0..16 and labels, as numpy arrays.

    Read from the file scikit-learn ships (datasets/data/digits.csv.gz: 64 pixels and the label per
    line), without importing scikit-learn, which pulls in SciPy and slows down every rank's start.
    If the file has moved, scikit-learn's own loader is used.
    """
    import importlib.util

    import numpy as np

    spec = importlib.util.find_spec("sklearn")  # finds the package without running its __init__
    path = os.path.join(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz") if spec else ""
    if os.path.isfile(path):
        table = np.loadtxt(path, delimiter=",")
        if table.shape == (1797, 65):
            return table[:, :64].reshape(-1, 8, 8), table[:, 64].astype(np.int64)
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return bunch.images, bunch.target


def load_digits_arrays():
    """The digits as uint8 images (0..16 stretched to 0..255) and labels, split by a fixed seed."""
    images, labels = bundled_digits()
    images = torch.from_numpy(images * (255 / 16)).round().to(torch.uint8)
    labels = torch.from_numpy(labels).long()
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(SPLIT_SEED))
    test, train = order[:TEST_SIZE], order[TEST_SIZE:]
    return (images[train], labels[train]), (images[test], labels[test])


def load_mnist_arrays(data_dir):
    """MNIST from files already on disk (torchvision layout DIR/MNIST/raw/); never downloads."""
    from torchvision.datasets import MNIST

    if not data_dir:
        raise ValueError(
            "--dataset mnist needs --data-dir DIR, the folder that holds MNIST/raw/; --dataset digits needs nothing"
        )
    raw = os.path.join(data_dir, "MNIST", "raw")
    try:
        sets = [MNIST(data_dir, train=train, download=False) for train in (True, False)]
    except RuntimeError as e:  # torchvision: "Dataset not found. You can use download=True ..."
        raise FileNotFoundError(
            f"--dataset mnist: no MNIST files under {raw} ({e}). Expected {', '.join(MNIST_FILES)} there "
            "(or the same names with .gz). This course never downloads data: copy the files there, or use "
            "--dataset digits, which needs nothing (scikit-learn ships it)."
        ) from None
    return [(s.data, s.targets.long()) for s in sets]


def datasets(name="digits", data_dir=None):
    """(train, test) Datasets of (1xHxW float image, label): augmented for training, normalized from the train set."""
    if name == "digits":
        (train_x, train_y), (test_x, test_y) = load_digits_arrays()
    elif name == "mnist":
        (train_x, train_y), (test_x, test_y) = load_mnist_arrays(data_dir)
    else:
        raise ValueError(f"unknown dataset {name!r}; choose digits (bundled, no files) or mnist (needs --data-dir)")
    scaled = train_x.float() / 255
    mean, std = scaled.mean().item(), scaled.std().item()
    return (
        Images(train_x, train_y, transforms(mean, std, augment=True)),
        Images(test_x, test_y, transforms(mean, std, augment=False)),
    )


def small_cnn(classes=10):
    """Two 3x3 convolutions and a linear layer; AdaptiveAvgPool makes 8x8 and 28x28 inputs both fit."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.AdaptiveAvgPool2d(4),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, classes),
    )


def save_atomic(state, path):
    """torch.save to a temporary name in the same folder, then rename: a reader sees all of it or nothing."""
    tmp = f"{path}.tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)  # atomic on one file system; a crash mid-save leaves the old file intact
