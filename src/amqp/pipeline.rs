//! Pipelined publisher confirms: many publishes in flight on one channel,
//! each judged by its own confirm and by the returns that name it.
//!
//! lapin hands a `basic.return` (an unroutable message) to whichever
//! confirm completes next, not to its own publish (see
//! [`Confirms`](super::publish::Confirms)). A pipeline therefore never
//! trusts the confirm a return came with: it collects every return of
//! its confirms and matches each to its publish by the message id the
//! returned message carries. That holds while the pipeline is the only
//! publisher on its channel and waits for every confirm it started (or
//! the channel is replaced): the broker sends a message's return before
//! its ack, and lapin attaches it to a confirm that completes no later
//! than that ack, so by the time a publish's own confirm has resolved, its
//! return (if any) sits on a confirm that has resolved too.

use std::time::Duration;

use futures_util::FutureExt as _;
use lapin::options::BasicPublishOptions;
use lapin::{BasicProperties, Channel, Confirmation, PublisherConfirm};
use tokio::time::Instant;

/// One message to publish.
pub(crate) struct Publish<'a> {
    /// The exchange (`""`: the default exchange).
    pub exchange: &'a str,
    /// The routing key.
    pub routing_key: &'a str,
    /// The body.
    pub body: &'a [u8],
    /// The message id, also set in `properties`: how a return is matched
    /// to its publish.
    pub message_id: &'a str,
    /// The properties (`message_id` included).
    pub properties: BasicProperties,
}

/// What became of a pipeline.
#[derive(Debug)]
pub(crate) struct Outcome {
    /// One verdict per publish tried, in order (`Err`: why it is not
    /// confirmed). Publishes after a failed send are not tried.
    pub verdicts: Vec<Result<(), String>>,
    /// Whether the channel can no longer be trusted: a confirm did not
    /// come in time (it, or its return, could still come later), or the
    /// channel failed.
    pub replace_channel: bool,
}

/// How one confirm ended.
enum Ended {
    Ack,
    Nack,
    Failed(String),
}

/// Publishes `publishes` in order on `channel` (in confirm mode, with no
/// other publisher meanwhile), all of them before waiting, and waits for
/// their confirms for at most `timeout`.
pub(crate) async fn publish_all(
    channel: &Channel,
    publishes: &[Publish<'_>],
    timeout: Duration,
) -> Outcome {
    let deadline = Instant::now() + timeout;
    let mut replace_channel = false;
    let mut confirms: Vec<PublisherConfirm> = Vec::with_capacity(publishes.len());
    let mut refused = None;
    let options = BasicPublishOptions {
        mandatory: true,
        ..BasicPublishOptions::default()
    };
    for p in publishes {
        let sent = channel.basic_publish(
            p.exchange.into(),
            p.routing_key.into(),
            options,
            p.body,
            p.properties.clone(),
        );
        match tokio::time::timeout_at(deadline, sent).await {
            Ok(Ok(confirm)) => confirms.push(confirm),
            Ok(Err(e)) => {
                replace_channel = true;
                refused = Some(e.to_string());
                break;
            }
            Err(_) => {
                replace_channel = true;
                refused = Some(format!("the broker took no message within {timeout:?}"));
                break;
            }
        }
    }
    let mut ended = Vec::with_capacity(confirms.len());
    let mut returned: Vec<Option<String>> = Vec::new();
    for mut confirm in confirms {
        // Past the deadline, still take what has come: a resolved confirm
        // may carry another publish's return.
        let confirmation = if Instant::now() < deadline {
            tokio::time::timeout_at(deadline, &mut confirm).await.ok()
        } else {
            (&mut confirm).now_or_never()
        };
        ended.push(match confirmation {
            Some(Ok(Confirmation::Ack(r))) => {
                returned.extend(r.map(|m| returned_id(&m)));
                Ended::Ack
            }
            Some(Ok(Confirmation::Nack(r))) => {
                returned.extend(r.map(|m| returned_id(&m)));
                Ended::Nack
            }
            Some(Ok(Confirmation::NotRequested)) => {
                Ended::Failed("publisher confirms are off".to_owned())
            }
            Some(Err(e)) => {
                replace_channel = true;
                Ended::Failed(e.to_string())
            }
            None => {
                replace_channel = true;
                Ended::Failed(format!("no confirm within {timeout:?}"))
            }
        });
    }
    // A return that names no publish of this pipeline cannot be placed:
    // then no ack of it counts.
    let stray = returned.iter().any(|id| {
        id.as_deref()
            .is_none_or(|id| !publishes.iter().any(|p| p.message_id == id))
    });
    let mut verdicts: Vec<Result<(), String>> = ended
        .into_iter()
        .zip(publishes)
        .map(|(ended, p)| match ended {
            Ended::Ack if returned.iter().any(|r| r.as_deref() == Some(p.message_id)) => {
                Err("unroutable: returned by the broker".to_owned())
            }
            Ended::Ack if stray => Err(
                "the broker returned a message this publisher cannot place: not counted as routed"
                    .to_owned(),
            ),
            Ended::Ack => Ok(()),
            Ended::Nack => Err("nacked by the broker".to_owned()),
            Ended::Failed(why) => Err(why),
        })
        .collect();
    verdicts.extend(refused.map(Err));
    Outcome {
        verdicts,
        replace_channel,
    }
}

/// The message id of a returned message.
fn returned_id(message: &lapin::message::BasicReturnMessage) -> Option<String> {
    message
        .properties
        .message_id()
        .as_ref()
        .map(|id| id.as_str().to_owned())
}
