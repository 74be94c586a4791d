"""Flow and congestion control: the strategies a sender's limit follows from its receivers'
status messages (``fc=``), the window a receiver advertises (``cc=``) and a sender's rate
(``rc=``), each an interface with one module per strategy, chosen by name in
:mod:`~slipstream.daemon.flow.registry`.  Above :mod:`slipstream.daemon.protocol`, below the
streams.

The one place the registry is filled: importing this package imports every shipped strategy
module, and each registers its class at its bottom (``register_flow_control(...)``)."""

from slipstream.daemon.flow import (  # noqa: F401 (each registers its strategy)
    cubic,
    max_multicast,
    min_multicast,
    rate_control,
    static_window,
    tagged_multicast,
    unicast,
)
