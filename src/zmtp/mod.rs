//! ZeroMQ's wire protocol (ZMTP 3.x, NULL mechanism) over std TCP: the PUB and ROUTER sides a
//! replica binds and the SUB and DEALER sides the balancer connects.
