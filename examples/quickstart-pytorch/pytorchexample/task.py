"""pytorchexample: the model, offline data and the train/test loops (plain PyTorch, no fedquant)."""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

NUM_CLASSES = 10
IMAGE_SIDE = 12
EXAMPLES_PER_PARTITION = 400
DATA_SEED = 2026  # the task (class templates) is the same on every node; each partition draws its own samples


#: The app's run config (``[tool.flwr.app.config]`` of pyproject.toml, which ``flwr run`` passes);
#: ``flwr.simulation.run_simulation`` passes none, so these fill in.
DEFAULT_CONFIG = {
    "num-server-rounds": 3,
    "fraction-evaluate": 0.5,
    "local-epochs": 1,
    "learning-rate": 0.1,
    "batch-size": 32,
    "codec": "eden:bits=2",
}


def run_config(context) -> dict:
    """The run config with :data:`DEFAULT_CONFIG` for the keys it lacks."""
    return {**DEFAULT_CONFIG, **context.run_config}


class Net(nn.Module):
    """A small CNN for 1 x 12 x 12 images, 10 classes."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )  # fmt: skip
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(16 * 3 * 3, 64), nn.ReLU(), nn.Linear(64, NUM_CLASSES))

    def forward(self, x):
        return self.classifier(self.features(x))


def _templates() -> torch.Tensor:
    generator = torch.Generator().manual_seed(DATA_SEED)
    return torch.randn(NUM_CLASSES, 1, IMAGE_SIDE, IMAGE_SIDE, generator=generator)


def _samples(count: int, seed: int) -> TensorDataset:
    """Noisy copies of the class templates: generated, so the app runs without a download."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, NUM_CLASSES, (count,), generator=generator)
    images = _templates()[labels] + 1.0 * torch.randn(count, 1, IMAGE_SIDE, IMAGE_SIDE, generator=generator)
    return TensorDataset(images, labels)


def load_data(partition_id: int, num_partitions: int, batch_size: int):
    """This node's partition, split 80 % train and 20 % test."""
    data = _samples(EXAMPLES_PER_PARTITION, DATA_SEED + 1 + partition_id + 1000 * num_partitions)
    train_size = int(0.8 * len(data))
    train, test = torch.utils.data.random_split(
        data, [train_size, len(data) - train_size], generator=torch.Generator().manual_seed(partition_id)
    )
    return DataLoader(train, batch_size=batch_size, shuffle=True), DataLoader(test, batch_size=batch_size)


def load_centralized_dataset():
    """The server's test set."""
    return DataLoader(_samples(1000, DATA_SEED - 1), batch_size=128)


def train(net, trainloader, epochs, lr, device):
    """Train the model on the training set; the mean loss."""
    net.to(device)
    criterion = nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    net.train()
    running_loss = 0.0
    for _ in range(epochs):
        for images, labels in trainloader:
            images, labels = images.to(device), labels.to(device)
            optimizer.zero_grad()
            loss = criterion(net(images), labels)
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
    return running_loss / (epochs * len(trainloader))


def test(net, testloader, device):
    """Validate the model on the test set: (mean loss, accuracy)."""
    net.to(device)
    criterion = nn.CrossEntropyLoss()
    correct, loss = 0, 0.0
    net.eval()
    with torch.no_grad():
        for images, labels in testloader:
            images, labels = images.to(device), labels.to(device)
            outputs = net(images)
            loss += criterion(outputs, labels).item()
            correct += (outputs.argmax(1) == labels).sum().item()
    return loss / len(testloader), correct / len(testloader.dataset)
