//! The NATS services beside the fold: `--query-subject` (queries and batches of lookups, through
//! the node's one serve state: `serve::ask_one` and `serve::ask_many`, as over HTTP) and
//! `--write-subject` (writes through the node's write path), each taken in the node's queue group
//! (`--query-group`), so that nodes sharing a subject and a group take each request on exactly
//! one of them. Replies go only to subjects under `--query-reply-prefix`.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::task::JoinHandle;

use foldhost_nats::NatsConnection;

use super::{NodeConfig, NodeError, in_span};

/// Subscribes `--query-subject` and `--write-subject` (when set), in that order, each in the
/// node's queue group, and starts serving them.
pub(super) async fn start(
    cfg: &NodeConfig,
    conn: &NatsConnection,
    served: Arc<crate::serve::ServeState>,
    write: &Arc<crate::write::WritePath>,
) -> Result<Vec<JoinHandle<()>>, NodeError> {
    let mut tasks = Vec::new();
    if let Some(subject) = &cfg.query_subject {
        let client = conn.client().await?;
        let sub = client
            .queue_subscribe(subject.clone(), cfg.query_group.clone())
            .await
            .map_err(|e| NodeError::Config(format!("--query-subject {subject}: {e}")))?;
        tracing::info!(event = "nats_queries_serving", subject = %subject, group = %cfg.query_group, "serving queries over NATS request/reply");
        tasks.push(in_span(serve_nats_queries(
            client,
            sub,
            cfg.query_reply_prefix.clone(),
            served,
        )));
    }
    if let Some(subject) = &cfg.write_subject {
        let client = conn.client().await?;
        let sub = client
            .queue_subscribe(subject.clone(), cfg.query_group.clone())
            .await
            .map_err(|e| NodeError::Config(format!("--write-subject {subject}: {e}")))?;
        tracing::info!(event = "nats_writes_serving", subject = %subject, group = %cfg.query_group, "taking writes over NATS request/reply");
        tasks.push(in_span(serve_nats_writes(
            client,
            sub,
            cfg.query_reply_prefix.clone(),
            write.clone(),
        )));
    }
    Ok(tasks)
}

/// `--query-subject`, taken in the node's queue group: each request's payload goes to the guest's
/// `query` ([`crate::serve::ask_one`]); the reply is the answer, or the error text with a
/// `Foldhost-Error: true` header. A request with `Content-Type: application/x-foldhost-lookups`
/// is a batch of lookups ([`crate::serve::ask_many`]), answered as `POST /query` answers one: the
/// framed results under the same content type. A request whose reply subject is not under the
/// configured prefix is dropped ([`foldhost_core::protocol::reply_subject_allowed`]). Every request
/// answered counts in the fold's `nats_queries_served`, before its reply goes out. At most
/// [`MAX_NATS_QUERIES`] are asked at once (more wait in the subscription), and at most
/// [`MAX_WAITING_NATS_QUERIES`] wait for a revision beside them.
async fn serve_nats_queries(
    client: async_nats::Client,
    mut sub: async_nats::Subscriber,
    reply_prefix: String,
    state: Arc<crate::serve::ServeState>,
) {
    use futures::StreamExt;
    let Some(positions) = state.positions.clone() else {
        return;
    };
    // Queries that wait for a revision wait beside the others, at most this many at once (the
    // rest are answered `behind` at once).
    let waiting = Arc::new(tokio::sync::Semaphore::new(MAX_WAITING_NATS_QUERIES));
    let in_flight = Arc::new(tokio::sync::Semaphore::new(MAX_NATS_QUERIES));
    while let Some(msg) = sub.next().await {
        let Some(reply_to) = msg.reply.clone() else {
            continue;
        };
        if !foldhost_core::protocol::reply_subject_allowed(&reply_to, &reply_prefix) {
            tracing::warn!(event = "nats_query_refused", reply = %reply_to, prefix = %reply_prefix, "query refused: its reply subject is not an inbox");
            continue;
        }
        let (asked, min_wait) = take_query(&msg, reply_to);
        match min_wait {
            Err(e) => {
                count_served(&state);
                reply_error(&client, asked.reply_to, "true", None, e).await;
            }
            Ok(None) => {
                let Ok(permit) = in_flight.clone().acquire_owned().await else {
                    return;
                };
                let (client, state) = (client.clone(), state.clone());
                tokio::spawn(tracing::Instrument::in_current_span(async move {
                    nats_query(&client, &state, asked).await;
                    drop(permit);
                }));
            }
            Ok(Some((min, wait_ms))) => {
                let Ok(permit) = waiting.clone().try_acquire_owned() else {
                    let lag = foldhost_core::protocol::lag_to(
                        min,
                        positions.status.applied_through.load(Ordering::Acquire),
                        positions.rate.per_second(),
                    );
                    count_served(&state);
                    let why = "too many reads waiting".into();
                    reply_error(&client, asked.reply_to, "behind", Some(lag.seconds), why).await;
                    continue;
                };
                let (client, state, p) = (client.clone(), state.clone(), positions.clone());
                tokio::spawn(tracing::Instrument::in_current_span(async move {
                    let deadline = tokio::time::Instant::now() + Duration::from_millis(wait_ms);
                    let through = p.status.wait_applied(min, deadline).await;
                    match foldhost_core::protocol::read_gate(min, through, p.rate.per_second()) {
                        Ok(()) => nats_query(&client, &state, asked).await,
                        Err(lag) => {
                            count_served(&state);
                            let why = format!("behind: applied through {through}, {min} asked");
                            let to = asked.reply_to;
                            reply_error(&client, to, "behind", Some(lag.seconds), why).await;
                        }
                    }
                    drop(permit);
                }));
            }
        }
    }
}

/// A query as taken from its message, and the revision it asks to read at or after with how
/// long it may wait for it (`None`: no revision asked; `Err`: the headers do not parse).
fn take_query(
    msg: &async_nats::Message,
    reply_to: async_nats::Subject,
) -> (NatsQuery, Result<Option<(u64, u64)>, String>) {
    let header = |name: &str| {
        msg.headers
            .as_ref()
            .and_then(|h| h.get(name))
            .map(|v| v.as_str().to_string())
    };
    let min = header(foldhost_core::protocol::MIN_REVISION_HEADER);
    let wait = header(foldhost_core::protocol::WAIT_MS_HEADER);
    let asked = NatsQuery {
        reply_to,
        payload: msg.payload.to_vec(),
        lookups: header("Content-Type").is_some_and(|t| crate::serve::is_lookups(&t)),
    };
    let min_wait = foldhost_core::protocol::parse_min_revision(min.as_deref()).and_then(|min| {
        foldhost_core::protocol::parse_read_wait(wait.as_deref()).map(|w| (min, w))
    });
    let min_wait = min_wait.map(|(min, wait_ms)| min.map(|m| (m, wait_ms)));
    (asked, min_wait)
}

/// A NATS query as taken: where its reply goes, its payload, and whether it is a batch.
struct NatsQuery {
    reply_to: async_nats::Subject,
    payload: Vec<u8>,
    /// `Content-Type: application/x-foldhost-lookups`.
    lookups: bool,
}

/// One request on `--query-subject` answered, counted before its reply goes out (a requester
/// that has its reply sees it counted).
fn count_served(state: &crate::serve::ServeState) {
    if let Some(p) = &state.positions {
        p.status.nats_queries_served.fetch_add(1, Ordering::Relaxed);
    }
}

/// One NATS query (or batch) asked of the fold, its answer — or why there is none — published to
/// its reply subject.
async fn nats_query(client: &async_nats::Client, state: &crate::serve::ServeState, q: NatsQuery) {
    let reply_to = q.reply_to;
    let why = |reply: crate::serve::Reply| String::from_utf8_lossy(&reply.body).trim().to_string();
    let answered = if q.lookups {
        match crate::serve::decode_lookups(&q.payload) {
            Err(e) => Err(format!("lookups: {e}")),
            Ok(lookups) => match crate::serve::ask_many(state, lookups).await {
                Ok(results) => Ok((crate::serve::encode_looked(&results), true)),
                Err(reply) => Err(why(reply)),
            },
        }
    } else {
        match crate::serve::ask_one(state, q.payload).await {
            Ok(Ok(answer)) => Ok((answer, false)),
            Ok(Err(e)) => Err(e.to_string()),
            Err(reply) => Err(why(reply)),
        }
    };
    count_served(state);
    let max = client.server_info().max_payload;
    let published = match answered {
        Ok((answer, _)) if answer.len() > max => {
            let why = format!(
                "the answer is {} bytes, over the server's max_payload of {max}: ask less at once",
                answer.len()
            );
            return reply_error(client, reply_to, "true", None, why).await;
        }
        Ok((answer, true)) => {
            let mut headers = async_nats::HeaderMap::new();
            headers.insert("Content-Type", crate::serve::LOOKUPS_CONTENT_TYPE);
            client
                .publish_with_headers(reply_to, headers, answer.into())
                .await
        }
        Ok((answer, false)) => client.publish(reply_to, answer.into()).await,
        Err(why) => return reply_error(client, reply_to, "true", None, why).await,
    };
    if let Err(e) = published {
        tracing::warn!(event = "nats_query_reply_failed", error = %e, "query reply not sent");
    }
}

/// Takes writes on a NATS subject, in the node's queue group (each write goes to one node of the
/// group, so exactly one publishes it): each request is a [`crate::write::WriteRequest`] (JSON), each
/// reply its [`crate::write::WriteAnswer`] (JSON) with the outcome in `Foldhost-Outcome`. At most
/// [`MAX_NATS_WRITES`] are in flight; more wait in the subscription.
async fn serve_nats_writes(
    client: async_nats::Client,
    mut sub: async_nats::Subscriber,
    reply_prefix: String,
    write: Arc<crate::write::WritePath>,
) {
    use futures::StreamExt;
    let in_flight = Arc::new(tokio::sync::Semaphore::new(MAX_NATS_WRITES));
    while let Some(msg) = sub.next().await {
        let Some(reply_to) = msg.reply.clone() else {
            continue;
        };
        if !foldhost_core::protocol::reply_subject_allowed(&reply_to, &reply_prefix) {
            tracing::warn!(event = "nats_write_refused", reply = %reply_to, prefix = %reply_prefix, "write refused: its reply subject is not an inbox");
            continue;
        }
        let Ok(permit) = in_flight.clone().acquire_owned().await else {
            return;
        };
        let (client, write) = (client.clone(), write.clone());
        tokio::spawn(tracing::Instrument::in_current_span(async move {
            let answer = write.write_json(&msg.payload).await;
            let mut headers = async_nats::HeaderMap::new();
            headers.insert("Foldhost-Outcome", answer.outcome.as_str());
            let body = serde_json::to_vec(&answer).unwrap_or_default();
            if let Err(e) = client
                .publish_with_headers(reply_to, headers, body.into())
                .await
            {
                tracing::warn!(event = "nats_write_reply_failed", error = %e, "write reply not sent");
            }
            drop(permit);
        }));
    }
}

/// Most NATS writes in flight at once.
const MAX_NATS_WRITES: usize = 64;

/// Most NATS queries (or batches) asked of the fold at once.
const MAX_NATS_QUERIES: usize = 64;

/// Most NATS queries waiting for a revision at once.
const MAX_WAITING_NATS_QUERIES: usize = 256;

/// An error reply to a NATS query: `Foldhost-Error: KIND` (`true`, or `behind` with
/// `Retry-After: SECONDS`) and the reason as the body.
async fn reply_error(
    client: &async_nats::Client,
    reply_to: async_nats::Subject,
    kind: &str,
    retry_after: Option<u64>,
    why: String,
) {
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Foldhost-Error", kind);
    if let Some(s) = retry_after {
        headers.insert("Retry-After", s.to_string().as_str());
    }
    if let Err(e) = client
        .publish_with_headers(reply_to, headers, why.into())
        .await
    {
        tracing::warn!(event = "nats_query_reply_failed", error = %e, "query reply not sent");
    }
}
