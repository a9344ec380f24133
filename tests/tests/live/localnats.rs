//! The test kit's local nats-server is ready only when *it* listens: a port another process holds
//! is an error at start, never a server that looks ready through someone else's listener.

use foldhost_localnats::{LocalNats, LocalNatsError};

#[test]
fn a_server_whose_port_another_process_holds_is_an_error_not_ready_through_the_other_listener()
-> anyhow::Result<()> {
    // Held for the whole test: a TCP connect to it succeeds (the kernel queues it), which is what
    // the kit used to take for its server being ready.
    let held = std::net::TcpListener::bind(("127.0.0.1", 0))?;
    let port = held.local_addr()?.port();
    let dir = tempfile::tempdir()?;
    match LocalNats::start_in(dir.path(), port) {
        Err(LocalNatsError::ExitedAtStart(why)) => {
            assert!(why.contains(&port.to_string()), "{why}");
        }
        Err(other) => anyhow::bail!("another error than an exit at start: {other}"),
        Ok(s) => anyhow::bail!("ready on port {} held by the test itself", s.port()),
    }
    drop(held);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_of_its_own_port_answers_there_and_keeps_it_across_a_restart() -> anyhow::Result<()>
{
    let mut s = LocalNats::start()?;
    let port = s.port();
    assert_ne!(port, 0, "the port the server chose is known");
    let client = async_nats::connect(s.url()).await?;
    assert!(client.server_info().jetstream, "a JetStream server answers");
    drop(client);
    s.restart()?;
    assert_eq!(s.port(), port, "a restart keeps the port");
    let client = async_nats::connect(s.url()).await?;
    assert!(client.server_info().jetstream);
    Ok(())
}
