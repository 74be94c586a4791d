"""Kafka's columns on the ``slipstream`` source: ``key`` and ``headers`` in an envelope,
``timestampType``, routing by ``stream_id``, and the columns a writer refuses; a real
SparkSession (local[2]) and real drivers."""

from __future__ import annotations

import re
import time

import pytest
from test_spark_bridge import (
    Collector,
    Drainer,
    offer,
    read_query,
    running_driver,
    spark,  # noqa: F401  (the module's session fixture)
    wait_connected,
)

from slipstream.client.layout import RESERVED_VALUE_ENVELOPE_BIT, RESERVED_VALUE_TIME_MASK
from slipstream.spark_bridge.envelope import decode_message, encode_message

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]

HEADERS = "array<struct<key: string, value: binary>>"
