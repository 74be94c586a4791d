"""slipstream."""

import slipstream._distribution  # noqa: F401  (first: refuses another distribution's `slipstream`)
