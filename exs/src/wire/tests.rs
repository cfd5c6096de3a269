use super::*;
use proptest::prelude::*;

fn samples() -> Vec<Message> {
    let advert = Advert {
        seq: 7,
        flags: AdvertFlags(0),
        len: 1 << 40,
        addr: 0xdead_beef,
        rkey: u64::MAX,
    };
    vec![
        Message {
            credits: 3,
            ack: Some(9),
            body: Body::Advert(advert),
        },
        Message {
            credits: 0,
            ack: Some(u32::MAX),
            body: Body::Ack,
        },
        Message::new(Body::Credit),
        Message::new(Body::Close(CloseReason::ShutdownWrite)),
        Message::new(Body::StreamAdvert(StreamAdvert {
            addr: 1,
            rkey: 2,
            len: 3,
            seq: 4,
            phase: 5,
            waitall: true,
            consumed: 6,
        })),
        Message::new(Body::StreamWindow { consumed: 99 }),
        Message::new(Body::ReadNotify { seq: 12 }),
        Message::new(Body::PersistentEnd { seq: 7, echo: true }),
        Message::new(Body::OffsetWritten(OffsetWritten {
            offset: 10,
            len: 20,
        })),
        Message::new(Body::StreamRing {
            addr: 0x1000,
            rkey: 0xabcd,
        }),
        Message::new(Body::StreamRingWanted),
    ]
}

#[test]
fn every_message_round_trips() {
    for m in samples() {
        let bytes = m.to_vec();
        let (back, at) = Message::decode(&bytes).unwrap();
        assert_eq!(back, m);
        assert_eq!(at, bytes.len());
    }
}

#[test]
fn immediate_advert_carries_its_data_after_the_body() {
    let a = Advert {
        seq: 1,
        flags: AdvertFlags(AdvertFlags::IMMEDIATE),
        len: 5,
        addr: 0,
        rkey: 0,
    };
    let m = Message::new(Body::Advert(a));
    let mut bytes = m.to_vec();
    assert!(
        Message::decode(&bytes).is_err(),
        "missing immediate data must be refused"
    );
    bytes.extend_from_slice(b"hello");
    let (back, at) = Message::decode(&bytes).unwrap();
    assert_eq!(back.inline_len(), 5);
    assert_eq!(&bytes[at..], b"hello");
    bytes.push(0);
    assert!(matches!(
        Message::decode(&bytes),
        Err(WireError::LengthMismatch { .. })
    ));
}

#[test]
fn header_fields_are_little_endian_at_fixed_offsets() {
    let m = Message {
        credits: 0x0102,
        ack: Some(0x0a0b0c0d),
        body: Body::Credit,
    };
    let b = m.to_vec();
    assert_eq!(
        b,
        [1, 3, 1, 0, 0x02, 0x01, 0, 0, 0x0d, 0x0c, 0x0b, 0x0a, 0, 0, 0, 0]
    );
}

#[test]
fn wrong_version_kind_flags_and_reserved_are_refused() {
    let good = Message::new(Body::Credit).to_vec();
    let mut b = good.clone();
    b[0] = 2;
    assert_eq!(Message::decode(&b), Err(WireError::Version(2)));
    let mut b = good.clone();
    b[1] = 200;
    assert_eq!(Message::decode(&b), Err(WireError::UnknownKind(200)));
    let mut b = good.clone();
    b[2] = 0x80;
    assert!(matches!(Message::decode(&b), Err(WireError::Reserved(_))));
    let mut b = good.clone();
    b[15] = 1;
    assert!(matches!(Message::decode(&b), Err(WireError::Reserved(_))));
    let mut b = good;
    b[6] = 4;
    assert!(matches!(
        Message::decode(&b),
        Err(WireError::TooShort { .. }) | Err(WireError::Invalid { .. })
    ));
}

#[test]
fn ack_without_flag_is_invalid() {
    let mut b = Message {
        credits: 0,
        ack: Some(1),
        body: Body::Ack,
    }
    .to_vec();
    b[2] = 0;
    assert!(Message::decode(&b).is_err());
}

#[test]
fn handshake_round_trips_and_fits_rdma_cm_private_data() {
    let hs = Handshake {
        sock_type: WireSockType::Stream,
        ctrl_window: 32,
        slot_size: 1024,
        send_credits: 16,
        recv_credits: 16,
        small_max: 512,
        stream_len: 1 << 20,
        stream_addr: 0x1000,
        stream_rkey: 77,
        native_imm: true,
    };
    const _: () = assert!(HANDSHAKE_LEN <= 56);
    let bytes = hs.encode();
    assert_eq!(Handshake::decode(&bytes).unwrap(), hs);
    let mut padded = bytes.to_vec();
    padded.extend_from_slice(&[0; 8]);
    assert_eq!(Handshake::decode(&padded).unwrap(), hs);
    let mut bad = bytes;
    bad[0] ^= 1;
    assert!(matches!(
        Handshake::decode(&bad),
        Err(WireError::BadMagic(_))
    ));
    assert!(matches!(
        Handshake::decode(&bytes[..20]),
        Err(WireError::TooShort { .. })
    ));
}

#[test]
fn imm_round_trips_direct_and_indirect_up_to_two_gib() {
    for n in [0, 1, 65_535, 65_536, 1 << 30, Imm::MAX_LEN] {
        assert_eq!(Imm::decode(Imm::Direct(n).encode()), Imm::Direct(n));
        assert_eq!(Imm::decode(Imm::Indirect(n).encode()), Imm::Indirect(n));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4000))]
    #[test]
    fn decoder_never_panics_on_random_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        let _ = Message::decode(&bytes);
        let _ = Handshake::decode(&bytes);
    }

    #[test]
    fn decoder_never_panics_on_mutated_messages(idx in 0usize..8, flips in proptest::collection::vec((0usize..80, any::<u8>()), 1..6), extra in 0usize..40) {
        let mut bytes = samples()[idx].to_vec();
        bytes.extend(std::iter::repeat_n(0xAB, extra));
        for (at, v) in flips {
            if let Some(b) = bytes.get_mut(at) { *b = v; }
        }
        if let Ok((m, at)) = Message::decode(&bytes) {
            // Whatever decodes must re-encode to the same header and body.
            prop_assert_eq!(&m.to_vec()[..], &bytes[..at]);
        }
    }
}

/// Found by `cargo fuzz run wire`: an immediate advert whose length is near u64::MAX made the expected-length
/// sum overflow (a panic with overflow checks, a wrapped length that could match without them).
#[test]
fn immediate_advert_with_length_near_u64_max_is_rejected() {
    for len in [u64::MAX, u64::MAX - 47, u64::MAX - 16] {
        let m = Message::new(Body::Advert(Advert {
            seq: 0,
            flags: AdvertFlags(AdvertFlags::IMMEDIATE),
            len,
            addr: 0,
            rkey: 0,
        }));
        let mut b = m.to_vec();
        b.extend_from_slice(&[0xe7; 31]);
        assert!(
            matches!(Message::decode(&b), Err(WireError::LengthMismatch { .. })),
            "len {len}"
        );
    }
}

/// Encodes `msgs` one after another in one buffer, each but the last flagged [`FLAG_MORE`] (how a coalescing
/// sender fills a pack buffer), with `inline` bytes of immediate data after each immediate advert.
fn pack(msgs: &[Message], inline: u8) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, m) in msgs.iter().enumerate() {
        let mut b = vec![0u8; m.encoded_len()];
        m.encode_framed(&mut b, i + 1 < msgs.len());
        out.extend_from_slice(&b);
        out.extend(std::iter::repeat_n(inline, m.inline_len()));
    }
    out
}

/// Walks a buffer of framed messages.
fn unpack(bytes: &[u8]) -> Result<Vec<Message>, WireError> {
    frames(bytes).map(|r| r.map(|(_, f)| f.msg)).collect()
}

#[test]
fn several_messages_share_a_buffer_in_order() {
    let mut msgs = samples();
    msgs.push(Message::new(Body::Advert(Advert {
        seq: 1,
        flags: AdvertFlags(AdvertFlags::IMMEDIATE),
        len: 5,
        addr: 0,
        rkey: 0,
    })));
    msgs.push(Message::new(Body::Credit));
    let bytes = pack(&msgs, 0x5a);
    assert_eq!(unpack(&bytes).unwrap(), msgs);
    // The immediate data sits between its advert and the next header.
    let mut end = 0;
    for (r, m) in frames(&bytes).zip(&msgs) {
        let (at, f) = r.unwrap();
        assert_eq!(at, end, "each message starts where the one before it ended");
        assert!(bytes[at + f.inline_at..at + f.end]
            .iter()
            .all(|&b| b == 0x5a));
        assert_eq!(f.end - f.inline_at, m.inline_len());
        end = at + f.end;
    }
    assert_eq!(end, bytes.len());
}

#[test]
fn a_message_flagged_more_must_be_followed_by_one() {
    let mut alone = vec![0u8; HEADER_LEN];
    Message::new(Body::Credit).encode_framed(&mut alone, true);
    assert!(matches!(
        Message::decode_framed(&alone),
        Err(WireError::TooShort { .. })
    ));
    // `decode` takes one message alone in its buffer: the flag is refused there.
    let two = pack(&[Message::new(Body::Credit), Message::new(Body::Credit)], 0);
    assert!(Message::decode(&two).is_err());
    // Without the flag, trailing bytes are still a length mismatch.
    let mut trailing = Message::new(Body::Credit).to_vec();
    trailing.extend_from_slice(&[0; HEADER_LEN]);
    assert!(matches!(
        Message::decode_framed(&trailing),
        Err(WireError::LengthMismatch { .. })
    ));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]
    #[test]
    fn packed_buffers_round_trip(idx in proptest::collection::vec(0usize..11, 1..12)) {
        let all = samples();
        let msgs: Vec<Message> = idx.iter().map(|&i| all[i]).collect();
        prop_assert_eq!(unpack(&pack(&msgs, 1)).unwrap(), msgs);
    }

    #[test]
    fn packed_decoder_never_panics_on_mutated_buffers(idx in proptest::collection::vec(0usize..11, 1..5), flips in proptest::collection::vec((0usize..300, any::<u8>()), 1..6), cut in 0usize..40) {
        let all = samples();
        let msgs: Vec<Message> = idx.iter().map(|&i| all[i]).collect();
        let mut bytes = pack(&msgs, 7);
        for (at, v) in flips {
            if let Some(b) = bytes.get_mut(at) { *b = v; }
        }
        bytes.truncate(bytes.len().saturating_sub(cut));
        let _ = unpack(&bytes);
    }
}
