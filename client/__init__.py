"""slipstream.client: the application API, the log buffer, codecs and counters.

>>> from slipstream.client import Client
>>> with Client.connect() as client:
...     pub = client.add_publication("aeron:ipc", 1001)
...     sub = client.add_subscription("aeron:ipc", 1001)
"""

import slipstream._distribution  # noqa: F401  (first: refuses another distribution's `slipstream`)
from slipstream.client.client import Client, default_directory
from slipstream.client.counters import Counter, CounterReader
from slipstream.client.errors import (
    BackPressuredError,
    ChannelError,
    ChannelRejectedError,
    ChannelWarning,
    ClosedError,
    ConfigurationError,
    DataLossError,
    DriverAlreadyRunningError,
    DriverDirectoryError,
    DriverError,
    DriverNotRunningError,
    DriverTimeoutError,
    InvalidArgumentError,
    MessageTooLongError,
    RegistrationError,
    SlipstreamError,
    UsageError,
)
from slipstream.client.image import Image
from slipstream.client.messages import (
    ControlledPollAction,
    GatheredMessages,
    Header,
    MessageBatch,
)
from slipstream.client.publication import (
    ADMIN_ACTION,
    BACK_PRESSURED,
    CLOSED,
    MAX_POSITION_EXCEEDED,
    NOT_CONNECTED,
    BufferClaim,
    ExclusivePublication,
    Publication,
    result_name,
)
from slipstream.client.subscription import Subscription

__all__ = [
    "ADMIN_ACTION",
    "BACK_PRESSURED",
    "CLOSED",
    "MAX_POSITION_EXCEEDED",
    "NOT_CONNECTED",
    "BackPressuredError",
    "BufferClaim",
    "ChannelError",
    "ChannelRejectedError",
    "ChannelWarning",
    "Client",
    "ClosedError",
    "ConfigurationError",
    "ControlledPollAction",
    "Counter",
    "CounterReader",
    "DataLossError",
    "DriverAlreadyRunningError",
    "DriverDirectoryError",
    "DriverError",
    "DriverNotRunningError",
    "DriverTimeoutError",
    "ExclusivePublication",
    "GatheredMessages",
    "Header",
    "Image",
    "InvalidArgumentError",
    "MessageBatch",
    "MessageTooLongError",
    "Publication",
    "RegistrationError",
    "SlipstreamError",
    "Subscription",
    "UsageError",
    "default_directory",
    "result_name",
]
