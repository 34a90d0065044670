"""Shared test fixtures."""

import pytest

from fedquant.codecs import available_codecs, get_codec


@pytest.fixture(params=available_codecs())
def any_codec(request):
    """Every registered codec with its default parameters."""
    return get_codec(request.param)
