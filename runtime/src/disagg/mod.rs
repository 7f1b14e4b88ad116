//! Disaggregated prefill/decode: the protocol state machine, the two node roles and the
//! in-process pair used by tests.

pub mod protocol;
