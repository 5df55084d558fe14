//! Operations on a running deployment: tools for the `onceonly` CLI and for
//! operators' own programs.

#[cfg(any(feature = "amqp", feature = "kafka"))]
#[cfg_attr(docsrs, doc(cfg(any(feature = "amqp", feature = "kafka"))))]
pub mod replay;
